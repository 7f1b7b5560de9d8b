"""Thresholds the sink statistics and the papers' metric sets share (no torch: the registries read them)."""

EPSILON = 0.3  # Gu et al.'s sink threshold on a head's attention share on the first token
LAMBDA_GUARD = 0.05  # 1 − λ at or below which a differential head's share is undefined (λ ≥ 0.95, λ > 1 included)
