"""Which kernels compute the statistics, Triton's or torch's, and the contract both paths keep.

`kernels` is "auto" (Triton on CUDA tensors where Triton imports and its site kernel passes a contract check on that
device, `verify`; torch elsewhere), "triton" or "torch". Triton is an
optional extra (`pip install 'diffquant[gpu]'`): nothing imports it until a choice resolves to it, so `import diffquant`
works without it (and this module imports neither, so the command line can name the choices at once). "triton" on a CPU tensor runs only under Triton's interpreter (TRITON_INTERPRET=1, set before Triton
is imported: how the test suite runs every kernel without a GPU, at about 12 ms per program instance).

The contract (DESIGN.md §8), kept by the torch path (stats/site_stats.py `_passes`, the explicit attention of
taps/attention.py) and the Triton path (kernels/site.py, kernels/flash.py), and tested on both (tests/test_kernels.py
under the interpreter, benchmarks/gpu_check.py on CUDA):

- integers (counts, non-finite counts, histogram bins, LLM.int8 hits) and maxima (row, channel, head, position) are
  exact, in any order of summation: the Triton path takes |x| and its histogram bin from x's bit pattern (integer
  operations, so a GPU's flush-to-zero cannot move a subnormal), and adds bins with integer atomics;
- top-k (values, coordinates, token ids, the order of ties) is exact: rows are chosen by their maxima and searched by
  the same stable merge (stats/topk.py: kept entries first, then in the order offered);
- moments are deterministic (a fixed reduction order: two runs give the same bits) and within 1e-6 of a float64
  reference: |ΔM_p| ≤ 1e-6·Σ|x − μ|^p for p = 2..4 (scaled by the absolute power sum, since M₃ can be near 0), and
  kurtosis and standard deviation within 1e-6 relative. The Triton path computes per element in float32 and sums in
  float64: each tile's sum and its central power sums about its own mean, tiles merged in a fixed order (Pébay);
- a tensor given in blocks gives the statistics of the whole tensor (integers and maxima exactly, moments within
  the bounds above);
- inf and NaN are counted apart and enter no other statistic; masked values (padding, keys a query may not attend)
  enter none, and never reach a histogram bin (sending them to bin 0 and subtracting is free on a CPU, but on a GPU
  it is millions of atomic adds to one address);
- float32 and bfloat16 activations are read in their own dtype and widened to float32 exactly;
- attention logits are computed in float32 with `input_precision="ieee"` where the input is float32 (Triton's default,
  TF32, keeps 10 bits of mantissa).
"""

from __future__ import annotations

import contextlib
import contextvars
import os

from diffquant.errors import DiffquantError

CHOICES = ("auto", "triton", "torch")
_chosen: contextvars.ContextVar[str] = contextvars.ContextVar("diffquant_kernels", default="auto")
_triton: list[bool] = []  # whether Triton imports, found once
_verified: dict[str, str | None] = {}  # device -> None (the site kernel kept the contract there) or why not
_checks: list = []  # the contract check (stats/site_stats.py registers it: this module imports no statistics)


def check(kernels: str) -> str:
    """`kernels` if it is one of CHOICES, else one clear DiffquantError."""
    if kernels not in CHOICES:
        raise DiffquantError(f"unknown kernels {kernels!r}; choose one of: {', '.join(CHOICES)}")
    return kernels


def triton_available() -> bool:
    """Whether Triton imports here (tried once: importing it takes a second)."""
    if not _triton:
        try:
            import triton  # noqa: F401
        except ImportError:
            _triton.append(False)
        else:
            _triton.append(True)
    return _triton[0]


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter, on CPU tensors."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def resolve(kernels: str | None, device) -> str:
    """"triton" or "torch": the path `kernels` (None: the choice in force, see `chosen`) takes for tensors on
    `device`. Asking for "triton" where it cannot run is one clear DiffquantError."""
    import torch

    kernels = check(current() if kernels is None else kernels)
    device = torch.device(device)
    if kernels == "torch" or (kernels == "auto" and device.type != "cuda"):
        return "torch"
    if not triton_available():
        if kernels == "auto":
            return "torch"
        raise DiffquantError("kernels='triton' needs Triton, which does not import here: pip install 'diffquant[gpu]'")
    if kernels == "auto" and device.type == "cuda" and verify(device) is not None:
        return "torch"
    if device.type == "cuda" or (device.type == "cpu" and interpreting()):
        return "triton"
    raise DiffquantError(f"kernels='triton' runs on CUDA tensors, not on {device.type} (on CPU only under Triton's "
                         "interpreter, TRITON_INTERPRET=1); use kernels='auto' or 'torch' here")


def verify(device) -> str | None:
    """None if the fused site kernel keeps the contract on `device`, else why not: checked once per device, the first
    time "auto" would choose Triton there, on a small tensor with a mask, inf, NaN, a subnormal and ties, against the
    torch path (integers, maxima and top-k exact, moments within the contract). "auto" keeps to torch where it fails
    and says so once on stderr: a kernel that is wrong on some GPU or Triton version must not print numbers."""
    import sys

    key = str(device)
    if key not in _verified:
        try:
            _verified[key] = _checks[0](device) if _checks else "no contract check is registered"
        except Exception as e:  # noqa: BLE001 - a kernel that cannot run here is a reason too
            _verified[key] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
        if _verified[key] is not None:
            print(f"diffquant: Triton's statistics kernel failed its check on {key} ({_verified[key]}); using torch's "
                  "(kernels='auto')", file=sys.stderr)
    return _verified[key]


def register_check(check) -> None:
    """The contract check `verify` runs: check(device) -> None, or why the Triton path is wrong there."""
    _checks[:] = [check]


def current() -> str:
    """The choice in force: "auto" unless a `chosen` block says otherwise."""
    return _chosen.get()


@contextlib.contextmanager
def chosen(kernels: str | None):
    """Run a block with this choice in force (None: leave it as it is); restored on exit. The profiler and the sweep
    wrap their forwards in it, so the attention function (taps/attention.py) takes the same path as the statistics."""
    if kernels is None:
        yield
        return
    token = _chosen.set(check(kernels))
    try:
        yield
    finally:
        _chosen.reset(token)
