"""A built-in table of common NVIDIA GPUs, to plan for a card the user does not have (or to fill in what
detection cannot read), with forgiving name matching: "4060 laptop", "RTX 4060 Laptop GPU" and
"NVIDIA GeForce RTX 4060 Laptop GPU" all find the same row.

``tflops`` is the dense 16-bit tensor throughput with fp32 accumulation from the vendors' spec sheets (GeForce
cards run that at half their fp16-accumulate rate; laptop numbers vary with the power limit). It only feeds the
"about how fast" estimate.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

RTX_CONSUMER = "rtx-consumer"
RTX_WORKSTATION = "rtx-workstation"
BLACKWELL_DATACENTER = "blackwell-datacenter"
DGX_SPARK = "dgx-spark"
HOPPER = "hopper"
AMPERE_DATACENTER = "ampere-datacenter"
OTHER_NVIDIA = "other-nvidia"
CPU = "cpu"

CUDNN_ATTENTION_MAJORS = (9,)
"""Compute-capability majors where a row holding one document runs through cuDNN's fused attention kernel by
default: Hopper, measured on the H200 (one 4,096-token row, 32 query and 8 K/V heads of 128: 1.23 against 2.03 ms
forward + backward per layer for FlashAttention-2's varlen kernel; 16,384 tokens: 14.8 against 24.3 ms;
benchmarks/attention_kernels_h200.md). Other cards are not measured: there such a row takes the causal kernel SDPA
picks unless asked for (``--attention-backend cudnn``)."""

CLASS_LABELS = {
    RTX_CONSUMER: "RTX consumer",
    RTX_WORKSTATION: "RTX workstation",
    BLACKWELL_DATACENTER: "Blackwell datacenter",
    DGX_SPARK: "DGX Spark",
    HOPPER: "Hopper",
    AMPERE_DATACENTER: "Ampere datacenter",
    OTHER_NVIDIA: "other NVIDIA",
    CPU: "CPU",
}


@dataclass(frozen=True)
class GpuSpec:
    name: str
    compute_capability: tuple[int, int]
    vram_gib: float
    tflops: float
    gpu_class: str
    unified_memory: bool = False
    aliases: tuple[str, ...] = ()

    @property
    def laptop(self) -> bool:
        return "laptop" in self.name.lower()


def _rtx(name: str, cc: tuple[int, int], vram: float, tflops: float) -> GpuSpec:
    return GpuSpec(name, cc, vram, tflops, RTX_CONSUMER)


TURING, AMPERE, ADA, BLACKWELL = (7, 5), (8, 6), (8, 9), (12, 0)

GPUS: tuple[GpuSpec, ...] = (
    # GeForce RTX 20 (Turing): no bf16
    _rtx("RTX 2060", TURING, 6, 26), _rtx("RTX 2060 Super", TURING, 8, 29), _rtx("RTX 2070", TURING, 8, 30),
    _rtx("RTX 2070 Super", TURING, 8, 36), _rtx("RTX 2080", TURING, 8, 40), _rtx("RTX 2080 Super", TURING, 8, 45),
    _rtx("RTX 2080 Ti", TURING, 11, 54),
    _rtx("RTX 2060 Laptop", TURING, 6, 19), _rtx("RTX 2070 Laptop", TURING, 8, 24),
    _rtx("RTX 2080 Laptop", TURING, 8, 30), _rtx("RTX 2080 Super Laptop", TURING, 8, 32),
    # RTX 30 (Ampere)
    _rtx("RTX 3050", AMPERE, 8, 18), _rtx("RTX 3060", AMPERE, 12, 25), _rtx("RTX 3060 Ti", AMPERE, 8, 32),
    _rtx("RTX 3070", AMPERE, 8, 41), _rtx("RTX 3070 Ti", AMPERE, 8, 43), _rtx("RTX 3080", AMPERE, 10, 60),
    _rtx("RTX 3080 12GB", AMPERE, 12, 61), _rtx("RTX 3080 Ti", AMPERE, 12, 68), _rtx("RTX 3090", AMPERE, 24, 71),
    _rtx("RTX 3090 Ti", AMPERE, 24, 80),
    _rtx("RTX 3050 Laptop", AMPERE, 4, 12), _rtx("RTX 3050 Ti Laptop", AMPERE, 4, 14),
    _rtx("RTX 3060 Laptop", AMPERE, 6, 21), _rtx("RTX 3070 Laptop", AMPERE, 8, 28),
    _rtx("RTX 3070 Ti Laptop", AMPERE, 8, 31), _rtx("RTX 3080 Laptop", AMPERE, 16, 35),
    _rtx("RTX 3080 Ti Laptop", AMPERE, 16, 40),
    # RTX 40 (Ada)
    _rtx("RTX 4060", ADA, 8, 30), _rtx("RTX 4060 Ti", ADA, 8, 44), _rtx("RTX 4060 Ti 16GB", ADA, 16, 44),
    _rtx("RTX 4070", ADA, 12, 58), _rtx("RTX 4070 Super", ADA, 12, 71), _rtx("RTX 4070 Ti", ADA, 12, 80),
    _rtx("RTX 4070 Ti Super", ADA, 16, 88), _rtx("RTX 4080", ADA, 16, 97), _rtx("RTX 4080 Super", ADA, 16, 104),
    _rtx("RTX 4090", ADA, 24, 165),
    _rtx("RTX 4050 Laptop", ADA, 6, 23), _rtx("RTX 4060 Laptop", ADA, 8, 29), _rtx("RTX 4070 Laptop", ADA, 8, 37),
    _rtx("RTX 4080 Laptop", ADA, 12, 66), _rtx("RTX 4090 Laptop", ADA, 16, 85),
    # RTX 50 (Blackwell, sm_120)
    _rtx("RTX 5050", BLACKWELL, 8, 27), _rtx("RTX 5060", BLACKWELL, 8, 38), _rtx("RTX 5060 Ti", BLACKWELL, 16, 47),
    _rtx("RTX 5060 Ti 8GB", BLACKWELL, 8, 47), _rtx("RTX 5070", BLACKWELL, 12, 62),
    _rtx("RTX 5070 Ti", BLACKWELL, 16, 88), _rtx("RTX 5080", BLACKWELL, 16, 113), _rtx("RTX 5090", BLACKWELL, 32, 210),
    _rtx("RTX 5050 Laptop", BLACKWELL, 8, 22), _rtx("RTX 5060 Laptop", BLACKWELL, 8, 30),
    _rtx("RTX 5070 Laptop", BLACKWELL, 8, 40), _rtx("RTX 5070 Ti Laptop", BLACKWELL, 12, 50),
    _rtx("RTX 5080 Laptop", BLACKWELL, 16, 75), _rtx("RTX 5090 Laptop", BLACKWELL, 24, 105),
    # RTX workstation
    GpuSpec("RTX A2000", AMPERE, 6, 32, RTX_WORKSTATION), GpuSpec("RTX A4000", AMPERE, 16, 77, RTX_WORKSTATION),
    GpuSpec("RTX A4500", AMPERE, 20, 95, RTX_WORKSTATION), GpuSpec("RTX A5000", AMPERE, 24, 111, RTX_WORKSTATION),
    GpuSpec("RTX A6000", AMPERE, 48, 155, RTX_WORKSTATION),
    GpuSpec("RTX 2000 Ada", ADA, 16, 48, RTX_WORKSTATION), GpuSpec("RTX 4000 Ada", ADA, 20, 107, RTX_WORKSTATION),
    GpuSpec("RTX 4500 Ada", ADA, 24, 160, RTX_WORKSTATION), GpuSpec("RTX 5000 Ada", ADA, 32, 261, RTX_WORKSTATION),
    GpuSpec("RTX 6000 Ada", ADA, 48, 364, RTX_WORKSTATION),
    GpuSpec("RTX PRO 4000 Blackwell", BLACKWELL, 24, 150, RTX_WORKSTATION),
    GpuSpec("RTX PRO 4500 Blackwell", BLACKWELL, 32, 200, RTX_WORKSTATION),
    GpuSpec("RTX PRO 5000 Blackwell", BLACKWELL, 48, 270, RTX_WORKSTATION),
    GpuSpec("RTX PRO 6000 Blackwell", BLACKWELL, 96, 500, RTX_WORKSTATION, aliases=("RTX PRO 6000",)),
    # datacenter
    GpuSpec("Tesla V100", (7, 0), 32, 125, OTHER_NVIDIA, aliases=("V100",)),
    GpuSpec("Tesla T4", TURING, 15, 65, OTHER_NVIDIA, aliases=("T4",)),
    GpuSpec("A10", AMPERE, 24, 125, AMPERE_DATACENTER), GpuSpec("A10G", AMPERE, 24, 70, AMPERE_DATACENTER),
    GpuSpec("A40", AMPERE, 48, 150, AMPERE_DATACENTER),
    GpuSpec("A100 80GB", (8, 0), 80, 312, AMPERE_DATACENTER), GpuSpec("A100 40GB", (8, 0), 40, 312, AMPERE_DATACENTER),
    GpuSpec("A30", (8, 0), 24, 165, AMPERE_DATACENTER),
    GpuSpec("L4", ADA, 24, 121, OTHER_NVIDIA), GpuSpec("L40", ADA, 48, 181, OTHER_NVIDIA),
    GpuSpec("L40S", ADA, 48, 362, OTHER_NVIDIA),
    GpuSpec("H100 SXM", (9, 0), 80, 989, HOPPER), GpuSpec("H100 PCIe", (9, 0), 80, 756, HOPPER),
    GpuSpec("H100 NVL", (9, 0), 94, 835, HOPPER), GpuSpec("H200", (9, 0), 141, 989, HOPPER),
    GpuSpec("H200 NVL", (9, 0), 141, 835, HOPPER), GpuSpec("GH200", (9, 0), 96, 989, HOPPER),
    GpuSpec("B200", (10, 0), 180, 2250, BLACKWELL_DATACENTER),
    GpuSpec("B300", (10, 3), 270, 2250, BLACKWELL_DATACENTER),
    GpuSpec("GB200", (10, 0), 186, 2500, BLACKWELL_DATACENTER),
    GpuSpec("GB10", (12, 1), 128, 100, DGX_SPARK, unified_memory=True, aliases=("DGX Spark", "Spark")),
)  # fmt: skip

_QUALIFIERS = frozenset(
    {
        "ti",
        "super",
        "laptop",
        "pcie",
        "sxm",
        "nvl",
        "ada",
        "blackwell",
        "pro",
        "8gb",
        "12gb",
        "16gb",
        "40gb",
        "80gb",
        "g",
    }
)
_NOISE = frozenset({"nvidia", "geforce", "gpu", "tesla", "quadro", "edition", "workstation", "generation", "max", "q",
                    "design", "server", "with", "maxq", "the"})  # fmt: skip


def name_tokens(name: str) -> list[str]:
    """Lower-case words of a GPU name, with vendor noise dropped and laptop spellings unified."""
    text = name.lower().replace("mobile", "laptop").replace("notebook", "laptop").replace("max-q", "laptop")
    text = re.sub(r"(\d)(gb)\b", r"\1gb", text)
    text = re.sub(r"\b(a10)g\b", r"\1 g", text)  # A10G -> a10 g, so 'A10' prefers the plain A10
    words = re.findall(r"[a-z0-9]+", text)
    merged: list[str] = []
    for word in words:
        if word == "ti" or word not in _NOISE:
            merged.append(word)
    return [w for w in merged if w not in ("rtx",)] or words


def _model_token(tokens: list[str]) -> str | None:
    for token in tokens:
        if any(ch.isdigit() for ch in token) and not token.endswith("gb") and not token.startswith("sxm"):
            return token
    return None


def _score(query: list[str], candidate: list[str]) -> float | None:
    model = _model_token(candidate)
    if model is None or model not in query:
        return None
    q, c = set(query), set(candidate)
    missing_qualifiers = {t for t in c - q if t in _QUALIFIERS}
    extra_qualifiers = {t for t in q - c if t in _QUALIFIERS}
    return len(q & c) - 2 * len(missing_qualifiers) - len(extra_qualifiers)


def _vocabulary() -> frozenset[str]:
    words = {w for spec in GPUS for spelling in (spec.name, *spec.aliases) for w in name_tokens(spelling)}
    return frozenset(words | _QUALIFIERS | _NOISE | {"rtx", "hbm", "nvlink", "sxm", "oem"})


def find_gpu(name: str) -> GpuSpec | None:
    """The table row that best matches ``name`` (None when no row shares its model number, or the name has a
    word no NVIDIA GPU name has: "Voodoo 5 6000" is not an RTX 6000)."""
    query = name_tokens(name)
    vocabulary = _vocabulary()
    if any(word.isalpha() and word not in vocabulary for word in query):
        return None
    best: tuple[float, int, GpuSpec] | None = None
    for order, spec in enumerate(GPUS):
        for spelling in (spec.name, *spec.aliases):
            candidate = name_tokens(spelling)
            if candidate == query:
                return spec
            score = _score(query, candidate)
            if score is not None and (best is None or (score, -order) > (best[0], -best[1])):
                best = (score, order, spec)
    return best[2] if best else None


def gpu_names() -> list[str]:
    return [spec.name for spec in GPUS]
