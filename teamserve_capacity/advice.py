"""When a plan should come with a warning: the box may be the wrong tool, or the plan a fragile one.

The conditions are the README's "When not to build it" list, reduced to what a
plan can see: the concurrency asked for, the GPU's product class, whether the
users trust each other, and how many full-length requests the KV cache holds.
Each advice is ``{"id", "advice", "reason"}``; the planner returns them in
``advice`` and the table prints them after the verdict. None changes the flags
or the verdict.
"""

from __future__ import annotations

from typing import Any

# Below this many concurrent sequences the box cannot batch enough to pay off:
# the README's "fewer than about 4 people using it at the same time".
FEW_SEQUENCES = 4
# A --max-model-len that fits fewer full-length requests than this leaves the
# longest requests queueing behind each other (or preempting) as soon as a few
# users send long prompts at once. A judgement ("a handful"), not a vLLM limit.
FULL_LENGTH_MIN = 4


def advise(*, concurrent_sequences: int, gpu_names: list[str], geforce: bool,
           users_trust_each_other: bool, full_length_fit: int, max_model_len: int,
           fits: bool) -> list[dict[str, Any]]:
    """The advice that holds for a plan.

    Args:
        concurrent_sequences: the workload's concurrent sequences.
        gpu_names: nvidia-smi names of the GPUs planned for (for the text).
        geforce: whether any of them is a GeForce card (teamserve_capacity.gpus.is_geforce).
        users_trust_each_other: the inventory's statement (vllm_users_trust_each_other).
        full_length_fit: requests of ``max_model_len`` tokens the KV cache holds at once.
        max_model_len: the planned --max-model-len, tokens.
        fits: the plan's verdict (a plan that does not fit already names its levers).
    Returns:
        advice dicts, in this order: few sequences, GeForce licence, untrusted
        users, few full-length requests.
    """
    out: list[dict[str, Any]] = []
    if concurrent_sequences < FEW_SEQUENCES:
        out.append({
            "id": "few_sequences",
            "advice": f"only {concurrent_sequences} concurrent sequence(s): a hosted API, or a local runner on "
                      "each laptop, is likely cheaper than this box and has nothing to operate",
            "reason": f"a shared vLLM server pays off by batching many streams on one GPU; below about "
                      f"{FEW_SEQUENCES} at once the card mostly idles (README, When not to build it)",
        })
    if geforce:
        out.append({
            "id": "geforce_licence",
            "advice": f"{gpu_names[0]} is a GeForce card: check the licence question before serving a team "
                      "from it (this is not legal advice)",
            "reason": "NVIDIA's GeForce driver licence says the software is not licensed for datacenter "
                      "deployment and does not define 'datacenter'; whether a shared office server counts is "
                      "for your legal counsel (README, When not to build it)",
        })
    if not users_trust_each_other:
        out.append({
            "id": "untrusted_users",
            "advice": "users do not fully trust each other: give each user a per-request cache_salt (the "
                      "gateway or client sets it), or turn prefix caching off "
                      "(vllm_flags: {enable-prefix-caching: false}); for parties whose data must never "
                      "meet, use separate boxes",
            "reason": "prefix caching shares cached prompt blocks across every request with the same "
                      "prefix, so one user's timing can reveal another's prompts; cache_salt keeps blocks "
                      "apart per salt (vLLM docs, design/prefix_caching), and batching still puts every "
                      "party's data in one process",
        })
    if fits and 0 < full_length_fit < FULL_LENGTH_MIN:
        out.append({
            "id": "few_full_length",
            "advice": f"only {full_length_fit} request(s) of the full {max_model_len:,} tokens fit at once: "
                      "lower vllm_workload.max_context_tokens, or use an fp8 KV cache, if long requests "
                      "are common",
            "reason": f"with fewer than {FULL_LENGTH_MIN} full-length requests in the KV cache, a few users "
                      "sending long prompts at once queue behind each other or preempt the rest",
        })
    return out
