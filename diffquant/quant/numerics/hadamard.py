"""Orthogonal Hadamard matrices for rotations (QuaRot).

A Hadamard matrix of order n (entries ±1, H·Hᵀ = n·I) exists for the orders this module can build:
n = 2^k · m with m = 1 (Sylvester), m = q + 1 for a prime q ≡ 3 (mod 4) (Paley I: 4, 8, 12, 20, 24, 32, 44,
48, 60, 68, 72, 80, ...), or m = 2(q + 1) for a prime q ≡ 1 (mod 4) (Paley II: 12, 28, 36, 60, 76, 108, ...).
That covers every power of two, 576 = 16·36 (SmolLM2's width), 1536 = 128·12, 768 = 64·12, 5120 = 1024·(4+1)...
`orthogonal(n, seed)` returns H/√n with random signs on its columns (a randomised Hadamard, as QuaRot) when
n is covered, and otherwise a random orthogonal matrix (QR of a Gaussian, signs fixed) — also exact, just
dense to apply. Both are float64, built on the host (a CPU generator draws the same signs for every device);
callers move them to the device of the weights they rotate.
"""

from __future__ import annotations

import torch

HOST = torch.device("cpu")  # where the matrices are built, see the module doc


def _is_prime(q: int) -> bool:
    return q > 1 and all(q % d for d in range(2, int(q**0.5) + 1))


def _legendre(a: int, q: int) -> int:
    a %= q
    if a == 0:
        return 0
    return 1 if pow(a, (q - 1) // 2, q) == 1 else -1


def _jacobsthal(q: int) -> torch.Tensor:
    return torch.tensor([[_legendre(i - j, q) for j in range(q)] for i in range(q)], dtype=torch.float64, device=HOST)


def _paley1(q: int) -> torch.Tensor:
    """Order q + 1, q prime ≡ 3 (mod 4)."""
    Q = _jacobsthal(q)
    n = q + 1
    S = torch.zeros(n, n, dtype=torch.float64, device=HOST)
    S[0, 1:] = 1
    S[1:, 0] = -1
    S[1:, 1:] = Q
    return S + torch.eye(n, dtype=torch.float64, device=HOST)


def _paley2(q: int) -> torch.Tensor:
    """Order 2(q + 1), q prime ≡ 1 (mod 4)."""
    Q = _jacobsthal(q)
    n = q + 1
    C = torch.zeros(n, n, dtype=torch.float64, device=HOST)
    C[0, 1:] = 1
    C[1:, 0] = 1
    C[1:, 1:] = Q
    a = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64, device=HOST)
    b = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64, device=HOST)
    out = torch.zeros(2 * n, 2 * n, dtype=torch.float64, device=HOST)
    for i in range(n):
        for j in range(n):
            c = C[i, j]
            out[2 * i:2 * i + 2, 2 * j:2 * j + 2] = b if c == 0 else c * a
    return out


def _base(m: int) -> torch.Tensor | None:
    """A Hadamard matrix of order m from Paley's constructions, or None."""
    if m == 1:
        return torch.ones(1, 1, dtype=torch.float64, device=HOST)
    if m == 2:
        return torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64, device=HOST)
    if _is_prime(m - 1) and (m - 1) % 4 == 3:
        return _paley1(m - 1)
    if m % 2 == 0 and _is_prime(m // 2 - 1) and (m // 2 - 1) % 4 == 1:
        return _paley2(m // 2 - 1)
    return None


def hadamard(n: int) -> torch.Tensor | None:
    """A ±1 Hadamard matrix of order n (float64), or None when n = 2^k·m has no constructible m."""
    k = 0
    while n % (2 ** (k + 1)) == 0:
        k += 1
    for j in range(k, -1, -1):  # try m = n / 2^j from the smallest odd part up
        base = _base(n // 2**j)
        if base is not None:
            h = base
            sylvester = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64, device=HOST)
            for _ in range(j):
                h = torch.kron(sylvester, h)
            return h
    return None


def orthogonal(n: int, seed: int = 0) -> tuple[torch.Tensor, str]:
    """(an n×n orthogonal float64 matrix, "hadamard" or "random"): a randomised Hadamard where one exists."""
    g = torch.Generator().manual_seed(seed)
    h = hadamard(n)
    if h is not None:
        signs = torch.randint(0, 2, (n,), generator=g, device=HOST).to(torch.float64) * 2 - 1
        return h * signs / n**0.5, "hadamard"
    q, r = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64, device=HOST))
    return q * torch.sign(torch.diagonal(r)), "random"
