"""Device profiles: the published figures of common GPUs, for plans made for the device a user
will run on rather than for this CPU (``minidl plan --target v100``).

Figures are the vendors' datasheet peaks: FP32 throughput (CUDA cores: what the default
``fp32`` precision uses, TF32 not enabled), memory bandwidth and capacity. The host link is
given per direction as an *effective* copy rate, not the bus's nominal one: PCIe 3.0 x16 moves about
12 GB/s of pinned memory each way (16 GB/s nominal; vDNN measured 12.8 GB/s on a Titan X),
PCIe 4.0 x16 about 25 GB/s, PCIe 5.0 x16 about 50 GB/s. ``launch_s`` is the fixed cost of a
step's kernel launches. A custom device: ``custom:flops=15.7T,hbm=900G,link=12G,mem=16GiB``
(optional ``d2h=``, ``launch=``, and the tensor-core rates ``tf32=``, ``fp16=``, ``bf16=``;
sizes and rates take the suffixes of :func:`~.units.parse_size` in decimal units: ``T`` = 1e12).

Matrix products (convolution, linear, attention, RNN cells) under a precision other than
``fp32`` run at the tensor-core rate of their dtype (:meth:`DeviceProfile.matmul_rate`): the
datasheets' dense figures (without 2:4 sparsity) with float32 accumulation. A rate of 0 means
the GPU has no such units: those products are priced at its FP32 rate.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..ir.units import parse_size

__all__ = ["DeviceProfile", "PROFILES", "TensorCoreRates", "get_target", "target_names"]


@dataclass(frozen=True)
class TensorCoreRates:
    """Dense tensor-core FLOP/s of matrix products per input precision (float32
    accumulation); 0: no such units (priced at the FP32 rate)."""

    tf32: float = 0.0
    fp16: float = 0.0
    bf16: float = 0.0


@dataclass(frozen=True)
class DeviceProfile:
    """What the cost model needs of a device: rates in per-second units, capacity in bytes."""

    name: str
    flops_per_s: float
    hbm_bytes_per_s: float
    link_h2d_bytes_per_s: float
    link_d2h_bytes_per_s: float
    capacity_bytes: int
    launch_s: float = 5e-6
    #: Where the figures come from (datasheet, generation of the host link).
    source: str = ""
    #: Tensor-core rates of matrix products (:class:`TensorCoreRates`).
    tensor_cores: TensorCoreRates = TensorCoreRates()

    def matmul_rate(self, matmul_dtype: str) -> tuple[str, float]:
        """``(name, FLOP/s)`` of matrix products in ``matmul_dtype`` (``"bfloat16"``,
        ``"float16"``, ``"tf32"``, or ``""`` for float32): the tensor-core rate, or the FP32
        rate (named so) where the GPU has no such units."""
        tensor = self.tensor_cores
        name, rate = {"tf32": ("tf32", tensor.tf32), "float16": ("fp16", tensor.fp16),
                      "bfloat16": ("bf16", tensor.bf16)}.get(matmul_dtype, ("fp32", 0.0))
        if rate > 0:
            return f"{name} tensor", rate
        return ("fp32" if name == "fp32" else f"fp32 (no {name} units)"), self.flops_per_s

    def describe_rates(self) -> str:
        """The matrix rates per precision, one line (``- ``: no such units)."""
        rates = [f"{n} {r / 1e12:.1f}" if r > 0 else f"{n} -" for n, r in (
            ("FP32", self.flops_per_s), ("TF32", self.tensor_cores.tf32),
            ("FP16", self.tensor_cores.fp16), ("BF16", self.tensor_cores.bf16))]
        return f"{self.name} matrix TFLOP/s: " + ", ".join(rates)

    def describe(self) -> str:
        return (f"{self.name}: {self.flops_per_s / 1e12:.1f} TFLOP/s FP32, "
                f"{self.hbm_bytes_per_s / 1e9:.0f} GB/s memory, host link "
                f"{self.link_h2d_bytes_per_s / 1e9:.0f}/{self.link_d2h_bytes_per_s / 1e9:.0f} GB/s "
                f"(h2d/d2h), {self.capacity_bytes / 2**30:.0f} GiB")


_GIB = 1 << 30
_PCIE3, _PCIE4, _PCIE5 = 12e9, 25e9, 50e9

#: Published figures (FP32 peak, memory bandwidth, capacity; effective host link; dense
#: tensor-core rates in TFLOP/s as the datasheet cited beside each gives them, the halves of
#: its "with sparsity" figures where it gives only those).
PROFILES: dict[str, DeviceProfile] = {p.name: p for p in [
    # GeForce GTX Titan X (Maxwell GM200) specifications (NVIDIA, 2015): 6.6 TFLOP/s FP32.
    # No tensor cores, no TF32 or BF16; FP16 arithmetic has no faster rate than FP32 on
    # Maxwell (cuDNN computes half data in float32), so half products run at the FP32 rate.
    DeviceProfile("titanx-maxwell", 6.6e12, 336.5e9, _PCIE3, _PCIE3, 12 * _GIB,
                  source="GeForce GTX Titan X (Maxwell, 2015), PCIe 3.0 x16"),
    # NVIDIA Tesla P100 datasheet (2016), PCIe 16 GB: 9.3 TFLOP/s single, 18.7 half
    # precision (paired FP16 on CUDA cores: no tensor cores, no TF32 or BF16).
    DeviceProfile("p100", 9.3e12, 732e9, _PCIE3, _PCIE3, 16 * _GIB,
                  source="Tesla P100 PCIe 16 GB, PCIe 3.0 x16",
                  tensor_cores=TensorCoreRates(fp16=18.7e12)),
    # NVIDIA Tesla V100 GPU datasheet (2018), SXM2: 15.7 TFLOP/s single precision, 125
    # tensor (FP16 with FP32 accumulation; PCIe card: 14 and 112). Volta has no TF32 or BF16.
    DeviceProfile("v100", 15.7e12, 900e9, _PCIE3, _PCIE3, 16 * _GIB,
                  source="Tesla V100 SXM2 16 GB, PCIe 3.0 x16 to the host",
                  tensor_cores=TensorCoreRates(fp16=125e12)),
    DeviceProfile("v100-32gb", 15.7e12, 900e9, _PCIE3, _PCIE3, 32 * _GIB,
                  source="Tesla V100 SXM2 32 GB, PCIe 3.0 x16 to the host",
                  tensor_cores=TensorCoreRates(fp16=125e12)),
    # NVIDIA A100 Tensor Core GPU datasheet (2021; 40 GB and 80 GB alike): FP32 19.5,
    # TF32 156, BF16 312, FP16 312 TFLOP/s dense (312 / 624 / 624 with sparsity).
    DeviceProfile("a100-40gb", 19.5e12, 1555e9, _PCIE4, _PCIE4, 40 * _GIB,
                  source="A100 40 GB (FP32; TF32 not enabled), PCIe 4.0 x16",
                  tensor_cores=TensorCoreRates(tf32=156e12, fp16=312e12, bf16=312e12)),
    DeviceProfile("a100-80gb", 19.5e12, 2039e9, _PCIE4, _PCIE4, 80 * _GIB,
                  source="A100 80 GB SXM (FP32; TF32 not enabled), PCIe 4.0 x16",
                  tensor_cores=TensorCoreRates(tf32=156e12, fp16=312e12, bf16=312e12)),
    # NVIDIA H100 Tensor Core GPU datasheet (2023), H100 SXM: FP32 67, TF32 989, BF16 1979,
    # FP16 1979 TFLOP/s "with sparsity": dense 494.7, 989.4, 989.4.
    DeviceProfile("h100", 67e12, 3350e9, _PCIE5, _PCIE5, 80 * _GIB,
                  source="H100 SXM 80 GB (FP32), PCIe 5.0 x16",
                  tensor_cores=TensorCoreRates(tf32=494.7e12, fp16=989.4e12, bf16=989.4e12)),
    # H200 SXM: NVIDIA's H200 Tensor Core GPU datasheet (nvidia.com/en-us/data-center/h200,
    # 2024): 141 GB HBM3e at 4.8 TB/s; FP32 (non-tensor) 67 TFLOP/s, the H100 SXM's (same
    # Hopper GH100 die and clocks); PCIe Gen5 x16 to the host (128 GB/s nominal both ways
    # together), so the effective pinned copy rate of the other PCIe 5.0 profiles. Capacity as
    # the datasheet's "141 GB" in GiB like the others (nvidia-smi there reads 143771 MiB).
    # Tensor cores as the H100 SXM's: TF32 989, BF16 / FP16 1979 TFLOP/s with sparsity, so
    # dense 494.7 and 989.4.
    DeviceProfile("h200", 67e12, 4800e9, _PCIE5, _PCIE5, 141 * _GIB,
                  source="H200 SXM 141 GB HBM3e (FP32), PCIe 5.0 x16",
                  tensor_cores=TensorCoreRates(tf32=494.7e12, fp16=989.4e12, bf16=989.4e12)),
    # NVIDIA Ada Lovelace architecture whitepaper (2022), RTX 4090: FP32 82.6; tensor with
    # FP32 accumulation (what mixed precision uses; GeForce runs it at half the FP16-
    # accumulate rate): FP16 / BF16 165.2, TF32 82.6 TFLOP/s dense.
    DeviceProfile("rtx4090", 82.6e12, 1008e9, _PCIE4, _PCIE4, 24 * _GIB,
                  source="GeForce RTX 4090, PCIe 4.0 x16",
                  tensor_cores=TensorCoreRates(tf32=82.6e12, fp16=165.2e12, bf16=165.2e12)),
]}
_ALIASES = {"titanx": "titanx-maxwell", "a100": "a100-40gb", "v100-16gb": "v100",
            "4090": "rtx4090"}


def target_names() -> list[str]:
    """The names :func:`get_target` accepts (besides ``custom:...``)."""
    return sorted(PROFILES) + sorted(_ALIASES)


def _rate(text: str, what: str) -> float:
    t = text.strip()
    scale = {"k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12, "p": 1e15}
    try:
        if t and t[-1].lower() in scale:
            return float(t[:-1]) * scale[t[-1].lower()]
        return float(t)
    except ValueError:
        raise ValueError(f"custom target: {what}={text!r} is not a rate (e.g. 15.7T, 900G, "
                         "12e9)") from None


#: A custom target's optional tensor-core rates, by key.
_TENSOR_KEYS = ("tf32", "fp16", "bf16")


def _custom(spec: str) -> DeviceProfile:
    fields: dict[str, str] = {}
    for part in spec.split(","):
        if not part.strip():
            continue
        key, sep, value = part.partition("=")
        if not sep:
            raise ValueError(f"custom target: {part!r} is not key=value")
        fields[key.strip().lower()] = value
    need = ("flops", "hbm", "link", "mem")
    missing = [k for k in need if k not in fields]
    unknown = sorted(set(fields) - {*need, "d2h", "launch", *_TENSOR_KEYS})
    if missing or unknown:
        raise ValueError(f"custom target needs flops=, hbm=, link=, mem= (optional d2h=, "
                         f"launch=, tf32=, fp16=, bf16=); missing {missing or 'none'}, unknown "
                         f"{unknown or 'none'}")
    link = _rate(fields["link"], "link")
    profile = DeviceProfile(
        "custom", _rate(fields["flops"], "flops"), _rate(fields["hbm"], "hbm"), link,
        _rate(fields["d2h"], "d2h") if "d2h" in fields else link,
        parse_size(fields["mem"]),
        _rate(fields["launch"], "launch") if "launch" in fields else 5e-6, source=spec,
        tensor_cores=TensorCoreRates(**{key: _rate(fields[key], key) for key in _TENSOR_KEYS
                                        if key in fields}))
    if min(profile.flops_per_s, profile.hbm_bytes_per_s, profile.link_h2d_bytes_per_s,
           profile.link_d2h_bytes_per_s, profile.capacity_bytes) <= 0:
        raise ValueError(f"custom target: every rate and the memory must be positive ({spec})")
    return profile


def get_target(name: str) -> DeviceProfile:
    """The profile named ``name`` (case-insensitive) or a ``custom:...`` one; ``ValueError``
    naming the valid names otherwise."""
    key = name.strip().lower()
    if key.startswith("custom:"):
        return _custom(key[len("custom:"):])
    key = _ALIASES.get(key, key)
    if key not in PROFILES:
        raise ValueError(f"unknown target {name!r}; valid targets: {', '.join(target_names())} "
                         "or custom:flops=...,hbm=...,link=...,mem=...")
    return PROFILES[key]
