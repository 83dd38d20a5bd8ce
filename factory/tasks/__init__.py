"""Embedded tasks shipped as deterministic data generators (demo traffic with reference answers).

``support_extract``: pull ``{"name", "email", "company", "intent"}`` out of a short support
message as compact JSON. SmolLM2-135M does not do this reliably out of the box (it chats, invents
keys, or misses the intent label), and a short LoRA run learns it, which makes it the task the
demo and the evals tests use to show a fine-tune beating its base model.

``agent_orders``: an order-support agent with four function tools (enum and nested arguments),
tool results and text answers, in four languages, with held-out requests phrased differently
and an exact tool-call scorer; ``bench/agent.py`` trains on it and scores base vs deployed.

``ticket_triage``: support tickets routed to one of five teams, answered with the label alone,
with varied phrasing (lengths, typos, casing, distractor words of another team), held-out tickets
phrased with frames the training data never used and an exact-label scorer; ``bench/loop.py``
times the loop from ingest to a live endpoint on it.

``planted`` (not a task): ``samples`` rows with a planted mix of problems and the drops curation
must make, for the curation tests and ``bench/curation.py``.
"""

from factory.tasks import agent_orders, ticket_triage
from factory.tasks.support_extract import (
    INTENTS,
    SYSTEM_PROMPT,
    field_accuracy,
    generate_conversations,
    generate_records,
)

__all__ = ["INTENTS", "agent_orders", "SYSTEM_PROMPT", "field_accuracy", "generate_conversations",
           "generate_records", "ticket_triage"]
