"""GPUs by name: the memory vLLM sees, the compute capability and the product class.

vLLM multiplies ``--gpu-memory-utilization`` by the total that
``torch.cuda.mem_get_info`` reports (vLLM 0.32 ``worker/utils.request_memory``),
which is less than nvidia-smi's ``memory.total`` by the memory the driver and
firmware reserve, a figure that differs between cards (346 MiB on an RTX 4090,
870 MiB on an A100 80GB) and that nvidia-smi prints as ``memory.reserved``.
On a box the nvidia_driver role reads both, and :func:`vllm_total` takes
``memory.total - memory.reserved``: on an H200 (driver 580.159.04) that is
143,771 - 616 = 143,155 MiB against PyTorch's 143,155.9 MiB (150,109,880,320
bytes), so it errs by under 1 MiB and towards less memory.

Without a box (a preflight on a fresh host, ``teamserve-plan --gpu``) the table
below stands in: each entry gives nvidia-smi's figure
(``--query-gpu=memory.total``, MiB, as public nvidia-smi outputs print it) and
the total vLLM/PyTorch reported on that card where a public log shows it
(``measured``); where none was found the total is nvidia-smi's minus
:data:`DEFAULT_RESERVED_MIB` and marked estimated.

Compute capabilities: NVIDIA's CUDA GPUs list (8.0 A100, 8.6 RTX 30xx, 8.9
Ada: RTX 40xx, L4, L40S, RTX 6000 Ada; 9.0 H100/H200; 12.0 RTX 50xx and RTX
PRO Blackwell). Classes: ``geforce`` (consumer cards, whose driver licence
excludes datacenter deployment), ``workstation`` (RTX PRO / RTX Ada),
``datacenter``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import PlanError

MIB = 1024 ** 2
GIB = 1024 ** 3

# The largest reservation measured among the cards below (A100 80GB: 81,920 MiB
# on nvidia-smi, 79.15 GiB seen by vLLM: 870.4 MiB, rounded up): used for cards
# without a measured total when the box's memory.reserved is not at hand, so an
# estimate errs towards less memory, not more (an H200 reserves 616 MiB).
DEFAULT_RESERVED_MIB = 871


@dataclass(frozen=True)
class GPUModel:
    """One GPU product.

    Attributes:
        key: short name for ``--gpu`` (e.g. ``h100-80gb``).
        names: nvidia-smi ``name`` strings of the product.
        nvidia_smi_mib: nvidia-smi ``memory.total``, MiB.
        vllm_gib: the total vLLM sees, GiB (None: estimated from nvidia-smi).
        source: where ``vllm_gib`` comes from.
        compute_cap: (major, minor).
        gpu_class: geforce, workstation or datacenter.
    """

    key: str
    names: tuple[str, ...]
    nvidia_smi_mib: int
    vllm_gib: float | None
    source: str
    compute_cap: tuple[int, int]
    gpu_class: str

    @property
    def total_bytes(self) -> int:
        """Memory vLLM sees on this card, bytes (measured, else nvidia-smi minus the default reservation)."""
        if self.vllm_gib is not None:
            return round(self.vllm_gib * GIB)
        return (self.nvidia_smi_mib - DEFAULT_RESERVED_MIB) * MIB

    @property
    def measured(self) -> bool:
        """Whether :attr:`total_bytes` comes from a real log rather than the default reservation."""
        return self.vllm_gib is not None

    @property
    def implied_reserved_mib(self) -> int:
        """The ``memory.reserved`` the table implies, MiB: nvidia-smi's total minus :attr:`total_bytes`, rounded.

        For a measured card this is what nvidia-smi should print as
        ``memory.reserved`` (within the 0.005 GiB rounding of the logged total,
        about 5 MiB); for an estimated one it is :data:`DEFAULT_RESERVED_MIB`.
        """
        return round(self.nvidia_smi_mib - self.total_bytes / MIB)


GPU_TABLE: tuple[GPUModel, ...] = (
    GPUModel("rtx-pro-6000", ("NVIDIA RTX PRO 6000 Blackwell Workstation Edition",), 97887, 94.97,
             "PyTorch 'GPU 0 has a total capacity of 94.97 GiB' on this card (public training and "
             "vLLM notes)", (12, 0), "workstation"),
    GPUModel("h200", ("NVIDIA H200",), 143771, 139.80,
             "PyTorch 'total capacity of 139.80 GiB' on 8x H200 (public SFT/RL run reports); "
             "torch.cuda.mem_get_info 143,155.9 MiB on an H200, driver 580.159.04",
             (9, 0), "datacenter"),
    GPUModel("h100-80gb", ("NVIDIA H100 80GB HBM3",), 81559, 79.18,
             "vLLM 0.11 'total 79.18 GiB' (llm-d-benchmark H100 logs, benchmarks/capacity); "
             "vLLM PR #10511 logged 79.22", (9, 0), "datacenter"),
    GPUModel("a100-80gb", ("NVIDIA A100-SXM4-80GB", "NVIDIA A100 80GB PCIe"), 81920, 79.15,
             "vLLM start-up logs: 79.15 GiB of an 80 GB A100", (8, 0), "datacenter"),
    GPUModel("a100-40gb", ("NVIDIA A100-SXM4-40GB", "NVIDIA A100-PCIE-40GB"), 40960, None,
             "estimated", (8, 0), "datacenter"),
    GPUModel("l40s", ("NVIDIA L40S",), 46068, 44.42,
             "vLLM start-up logs: 44.42 GiB of an L40S", (8, 9), "datacenter"),
    GPUModel("l4", ("NVIDIA L4",), 23034, None, "estimated", (8, 9), "datacenter"),
    GPUModel("rtx-6000-ada", ("NVIDIA RTX 6000 Ada Generation",), 49140, None, "estimated",
             (8, 9), "workstation"),
    GPUModel("rtx-5090", ("NVIDIA GeForce RTX 5090",), 32607, None, "estimated", (12, 0), "geforce"),
    GPUModel("rtx-4090", ("NVIDIA GeForce RTX 4090",), 24564, 23.65,
             "PyTorch 'total capacity of 23.65 GiB' on an RTX 4090 (public notes)", (8, 9), "geforce"),
    GPUModel("rtx-3090", ("NVIDIA GeForce RTX 3090",), 24576, 23.58,
             "vLLM 'total_gpu_memory=23.58GiB' (vLLM issue #10517)", (8, 6), "geforce"),
)


def find_gpu(name: str) -> GPUModel | None:
    """The table entry whose key or nvidia-smi name is ``name`` (case-insensitive), else None."""
    wanted = name.strip().lower()
    for gpu in GPU_TABLE:
        if wanted == gpu.key or wanted in (n.lower() for n in gpu.names):
            return gpu
    return None


def gpu_by_key(key: str) -> GPUModel:
    """The table entry for ``--gpu KEY`` (a key or an nvidia-smi name).

    Raises:
        PlanError: not in the table (the fix lists the keys and points at ``--gpu-mib``).
    """
    gpu = find_gpu(key)
    if gpu is None:
        raise PlanError("--gpu", key, "known GPUs: " + ", ".join(g.key for g in GPU_TABLE)
                        + "; for another card give --gpu-mib (nvidia-smi memory.total) and --compute-cap")
    return gpu


def gpu_row(gpu: GPUModel, index: int = 0) -> dict[str, object]:
    """An nvidia-smi-shaped row (what the nvidia_driver role reports) for a table entry.

    The row has no ``memory_reserved_mib``: a plan without a box uses the table's total.
    """
    return {"index": index, "name": gpu.names[0], "memory_total_mib": gpu.nvidia_smi_mib,
            "compute_cap": f"{gpu.compute_cap[0]}.{gpu.compute_cap[1]}", "driver_version": ""}


def vllm_total(name: str, memory_total_mib: int,
               memory_reserved_mib: int | None = None) -> tuple[int, str, GPUModel | None]:
    """The memory vLLM sees on a GPU nvidia-smi reported as ``name`` with ``memory_total_mib``.

    With ``memory_reserved_mib`` (nvidia-smi's ``memory.reserved`` read on the
    box) the total is ``memory.total - memory.reserved`` on any card, table or
    not: what ``torch.cuda.mem_get_info`` reports to within 1 MiB (see the
    module docstring). Without it, a card in the table whose nvidia-smi total
    matches gets the table's figure; any other (unknown, or a known name with
    another total: ECC toggled, a MIG slice) gets nvidia-smi's total minus
    :data:`DEFAULT_RESERVED_MIB`.

    Args:
        name: nvidia-smi's ``name``.
        memory_total_mib: nvidia-smi's ``memory.total``, MiB.
        memory_reserved_mib: nvidia-smi's ``memory.reserved``, MiB, or None
            when not read (a plan recorded before the field was read, a
            card whose driver prints ``[N/A]``); the caller validates it.
    Returns:
        (bytes, source text, the table entry or None).
    """
    gpu = find_gpu(name)
    if memory_reserved_mib is not None:
        return ((memory_total_mib - memory_reserved_mib) * MIB,
                f"nvidia-smi: memory.total {memory_total_mib:,} MiB - memory.reserved "
                f"{memory_reserved_mib:,} MiB", gpu)
    if gpu is not None and gpu.nvidia_smi_mib == memory_total_mib:
        if gpu.measured:
            return gpu.total_bytes, f"{gpu.vllm_gib:.2f} GiB measured: {gpu.source}", gpu
        return gpu.total_bytes, (f"estimated: {memory_total_mib:,} MiB (nvidia-smi) - "
                                 f"{DEFAULT_RESERVED_MIB} MiB"), gpu
    return ((memory_total_mib - DEFAULT_RESERVED_MIB) * MIB,
            f"estimated: {memory_total_mib:,} MiB (nvidia-smi) - {DEFAULT_RESERVED_MIB} MiB", gpu)


def is_geforce(name: str) -> bool:
    """Whether nvidia-smi's ``name`` is a GeForce (consumer) card."""
    gpu = find_gpu(name)
    return gpu.gpu_class == "geforce" if gpu is not None else "geforce" in name.lower()


def format_table() -> str:
    """The GPU table as text for ``teamserve-plan gpus``: key, nvidia-smi MiB, vLLM GiB, cc, class, source."""
    lines = [f"{'key':<14} {'nvidia-smi':>10}  {'vLLM sees':>10}  {'cc':<5} {'class':<12} source"]
    for g in GPU_TABLE:
        seen, cap = f"{g.total_bytes / GIB:.2f} GiB", f"{g.compute_cap[0]}.{g.compute_cap[1]}"
        lines.append(f"{g.key:<14} {g.nvidia_smi_mib:>6} MiB  {seen:>10}  {cap:<5} "
                     f"{g.gpu_class:<12} "
                     f"{g.source if g.measured else f'estimated: nvidia-smi - {DEFAULT_RESERVED_MIB} MiB'}")
    return "\n".join(lines)
