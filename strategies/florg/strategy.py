"""FLoRGStrategy: FLoRG's server step for every adapted layer at once (Gram aggregation,
decomposition, Procrustes: ``aggregate_florg_layers``, batched on the server's device) and
the task head's FedAvg.

Each round also records ``fedavg_gap_procrustes`` / ``fedavg_gap_truncate``, how far the
step lands from plain FedAvg on A (setting ``fedavg-gap``). Once a reply's A has r_n rows
other than the global r_max, every later round runs ``strategies.florg.ranks_torch``: a
factor per rank in use (``factors_by_rank``), each node sent the factor of its own rank
(``sent_state``; a node of unknown rank the r_max one), the server's own model the r_max
factor. With every client at r_max the homogeneous step runs. dp=central:
``aggregate_private``; round-mode=async: ``aggregate_buffered``. The decisions and what
they cost: docs/architecture.md, "Clients of different rank".
"""

from __future__ import annotations

import numpy as np

from flower_app.wire.ranks import rank_of
from flower_app.wire.records import split_state
from strategies.florg.dp import clip_florg_with_head, florg_sensitivity
from strategies.florg.dp_torch import private_florg_layers_torch
from strategies.florg.ranks_torch import aggregate_florg_ranks_layers
from strategies.florg.rule import RANK_MISMATCH_POLICIES, check_rank_mismatch
from strategies.florg.rule_torch import aggregate_florg_layers
from strategies.server.central_dp import noised_mean
from strategies.server.replies import Reply, ReplyRejected, metric_number
from strategies.server.strategy import AdapterStrategy
from strategies.shared.averaging import weighted_average

FEDAVG_GAP_CHOICES = ("both", "own", "off")


class FLoRGStrategy(AdapterStrategy):
    """Clients send each layer's A (r x k); the server runs the FLoRG step on all of them.

    ``server_device``: 'auto' (CUDA when the ServerApp sees a GPU), 'cpu' or 'cuda'.
    ``rank_mismatch``: 'procrustes' (the paper) or 'truncate' (see ``strategies.florg.rule``).
    ``fedavg_gap``: which ``fedavg_gap_<policy>`` diagnostics a round records: 'both'
    policies, the run's 'own' or 'off'.
    """

    def __init__(
        self,
        *args,
        procrustes: bool = True,
        fingerprint: int | None = None,
        server_device: str = "auto",
        rank_mismatch: str = "procrustes",
        fedavg_gap: str = "both",
        **kwargs,
    ) -> None:
        super().__init__(*args, **kwargs)
        from strategies.florg.rule_torch import resolve_server_device

        self.procrustes = procrustes
        self.fingerprint = fingerprint
        self.rank_mismatch = check_rank_mismatch(rank_mismatch)
        if fedavg_gap not in FEDAVG_GAP_CHOICES:
            raise ValueError(f"fedavg_gap must be one of {FEDAVG_GAP_CHOICES}, got {fedavg_gap!r}")
        self.fedavg_gap = fedavg_gap
        self.server_device = resolve_server_device(server_device)  # 'cuda' without a GPU fails
        # rank r_t < r_max -> {'<layer>.A': the factor of rank r_t} (empty while
        # every client has r_max, the homogeneous run)
        self.factors_by_rank: dict[int, dict[str, np.ndarray]] = {}

    def check_reply(self, message, server_round: int | None = None) -> Reply:
        """Also reject a client whose fixed L, R differ from the server's (other seed/model),
        or that does not say which it used (no ``lr-fingerprint``)."""
        reply = super().check_reply(message, server_round)
        if self.fingerprint is not None:
            theirs = metric_number(message.content["metrics"], "lr-fingerprint", required=False)
            if theirs is None:
                raise ReplyRejected("no L/R fingerprint ('lr-fingerprint' metric missing)")
            if theirs != self.fingerprint:
                raise ReplyRejected(
                    f"L/R fingerprint {int(theirs):012x} != server's {self.fingerprint:012x}"
                )
        return reply

    def server_step(
        self, payloads: list[dict[str, np.ndarray]], weights: np.ndarray, rank_mismatch: str
    ) -> tuple[dict[str, np.ndarray], dict[str, dict[str, float]]]:
        """The new A of every layer ('<layer>.A') and the diagnostics per aggregated block."""
        keys = [f"{layer}.A" for layer in self.layers()]
        # The replies' float32 arrays go in as they are (widened exactly on the device).
        new_As, per_layer = aggregate_florg_layers(
            {key: [p[key] for p in payloads] for key in keys},
            weights,
            {key: self.global_state[key] for key in keys},
            self.procrustes,
            device=str(self.server_device),
            rank_mismatch=rank_mismatch,
        )
        return dict(new_As), per_layer

    def sent_state(self, rank: int) -> dict[str, np.ndarray]:
        """The global state with the factor of ``rank`` (the top rows of the global A
        until a factor of that rank exists)."""
        if rank not in self.factors_by_rank:
            return super().sent_state(rank)
        own = self.factors_by_rank[rank]
        return {k: own.get(k, v) for k, v in self.global_state.items()}

    def aggregate_ranks(
        self, payloads: list[dict[str, np.ndarray]], weights: np.ndarray
    ) -> tuple[dict[str, np.ndarray], dict[str, float]]:
        """The mixed-rank step: a new factor of every rank in use for every layer; returns
        the r_max factors (the global A) and the diagnostics (the r_max factor's, plus
        ``gram_rel_error_r<r>`` and ``clients_r<r>`` per client rank)."""
        keys = [f"{layer}.A" for layer in self.layers()]
        ranks = [rank_of({k: p[k] for k in keys}) for p in payloads]
        requested = sorted({self.router.largest_rank, *ranks, *self.factors_by_rank})
        prev = {key: {r: self.sent_state(r)[key][:r] for r in requested} for key in keys}
        new, infos = aggregate_florg_ranks_layers(
            {key: [p[key] for p in payloads] for key in keys},
            weights,
            prev,
            device=str(self.server_device),
            procrustes=self.procrustes,
            rank_mismatch=self.rank_mismatch,
        )
        top = self.router.largest_rank
        self.factors_by_rank = {
            r: {key: new[key][r] for key in keys} for r in requested if r != top
        }
        info = summarize_layers({key: infos[key][top] for key in keys})
        for r in requested:
            errors = [float(infos[key][r]["gram_rel_error"]) for key in keys]
            info[f"gram_rel_error_r{r}"] = float(np.mean(errors))
        for r in sorted(set(ranks)):
            info[f"clients_r{r}"] = float(ranks.count(r))
        return {key: new[key][top] for key in keys}, info

    def aggregate_adapter(self, server_round, payloads, weights):
        keys = [f"{layer}.A" for layer in self.layers()]
        sent = self.global_state
        mixed = any(p[k].shape[0] != sent[k].shape[0] for p in payloads for k in keys)
        if self.method.heterogeneous_ranks and (mixed or self.factors_by_rank):
            return self.aggregate_ranks(payloads, weights)
        new_As, per_layer = self.server_step(payloads, weights, self.rank_mismatch)
        info = summarize_layers(per_layer)
        if self.procrustes and self.fedavg_gap != "off":
            info |= self.fedavg_gaps(payloads, weights, new_As)
        return new_As, info

    def aggregate_buffered(self, server_round, kept, weights):
        """round-mode=async with stale replies (or any buffer under a server rate η_g != 1):
        each layer's Gram average moved by every reply's Gram delta AₙᵀAₙ − A_vₙᵀA_vₙ, scaled
        by η_g times its staleness factor, decomposed and aligned with the current A
        (strategies/florg/buffered_rule.py); the head as the common strategy moves it
        (strategies/server/buffered_update.py)."""
        from strategies.florg.buffered_rule import aggregate_florg_buffered
        from strategies.server.buffered_update import moved_replies, staleness_factors

        factors = staleness_factors(kept, self.staleness_exponent, self.server_lr)
        new, per_layer = {}, {}
        for key in (f"{layer}.A" for layer in self.layers()):
            new[key], per_layer[key] = aggregate_florg_buffered(
                [r.arrays[key] for r in kept],
                [r.start[key] for r in kept],
                weights,
                factors,
                self.global_state[key],
                procrustes=self.procrustes,
                rank_mismatch=self.rank_mismatch,
            )
        heads = moved_replies(
            self.global_state, kept, self.staleness_exponent, self.head_keys(), self.server_lr
        )
        for key in self.head_keys():
            new[key] = weighted_average([h[key] for h in heads], weights, key)
        names = ("rank", "gram_rel_error", "drift", "eigengap", "negative_share")
        return new, summarize_layers(per_layer, names)

    def state_arrays(self) -> dict[str, np.ndarray]:
        """Also the factors of the other ranks in use (``rank<r>/<layer>.A``)."""
        arrays = super().state_arrays()
        for r, factors in self.factors_by_rank.items():
            arrays.update({f"rank{r}/{k}": v for k, v in factors.items()})
        return arrays

    def restore(self, arrays, state) -> None:
        super().restore(arrays, state)
        self.factors_by_rank = {}
        for name, value in arrays.items():
            head, _, key = name.partition("/")
            if head.startswith("rank") and head[4:].isdigit():
                factors = self.factors_by_rank.setdefault(int(head[4:]), {})
                factors[key] = np.asarray(value, np.float64)

    def blocks(self) -> dict[str, tuple[str, slice]]:
        """The units of the server step: name -> (A key, its rows); FLoRG: each layer's
        whole A."""
        return {f"{layer}.A": (f"{layer}.A", slice(None)) for layer in self.layers()}

    def aggregate_private(self, server_round, payloads, num_sampled):
        """dp=central (docs/privacy.md section 4): each client's update A_n - A_prev over
        every layer and its head update, scaled jointly (``clip_florg_with_head``: one
        Gaussian mechanism, not two); the noised mean Gram matrix of every block
        (Analyze-Gauss noise of std z Delta, Delta = C (2 max ||A_prev||_2 + C)), its
        eigendecomposition, top r, Procrustes (or not: the ablation), batched on the
        server's device (``private_florg_layers_torch``); the head is ``noised_mean``'s
        with the same z. The 'truncate' policy, whatever ``rank-mismatch`` says: once noise
        gives Q full rank it is the only one that makes sense."""
        dp, sent = self.dp, self.global_state
        c = dp.clipping_norm
        keys = [f"{layer}.A" for layer in self.layers()]
        head = list(split_state(sent)[1])
        prev = {k: sent[k] for k in keys}
        clipped: dict[str, list[np.ndarray]] = {k: [] for k in keys}
        heads = []
        for p in payloads:
            A = {k: np.asarray(p[k], np.float64) for k in keys}
            h = {k: np.asarray(p[k], np.float64) - sent[k] for k in head} or None
            ratio = sum(float(np.sum((A[k] - prev[k]) ** 2)) for k in keys)
            ratio += sum(float(np.sum(v * v)) for v in (h or {}).values())
            dp.clipped += int(ratio > c * c)
            cA, ch = clip_florg_with_head(A, h, c, prev_A=prev)
            for k in keys:
                clipped[k].append(cA[k])
            if ch is not None:
                heads.append(ch)
        blocks = self.blocks()
        new_blocks, infos = private_florg_layers_torch(
            {name: [a[rows] for a in clipped[key]] for name, (key, rows) in blocks.items()},
            {name: prev[key][rows] for name, (key, rows) in blocks.items()},
            c,
            dp.noise_multiplier,
            dp.rng,
            centred=True,
            num_sampled=num_sampled,
            procrustes=self.procrustes,
            device=str(self.server_device),
        )
        new = {
            key: np.concatenate([new_blocks[n] for n, (k, _) in blocks.items() if k == key])
            for key in keys
        }
        if heads:
            mean = noised_mean(heads, c, dp.noise_multiplier, dp.rng, num_sampled=num_sampled)
            new.update({k: sent[k] + mean[k] for k in head})
        info = summarize_layers(infos, ("rank", "drift", "eigengap", "negative_eigenvalues"))
        info["dp-sensitivity"] = florg_sensitivity(
            c, {n: prev[k][r] for n, (k, r) in blocks.items()}
        )
        info["dp-noise-std"] = float(next(iter(infos.values()))["noise_std"])
        return new, info

    def fedavg_gaps(
        self,
        payloads: list[dict[str, np.ndarray]],
        weights: np.ndarray,
        new_As: dict[str, np.ndarray],
    ) -> dict[str, float]:
        """``fedavg_gap_<policy>``: the mean over layers of ||A_new - Σ wₙ Aₙ||_F /
        ||A_new - A_prev||_F, for the run's own policy (from ``new_As``) and, with
        ``fedavg_gap='both'``, the other one (its step computed here and discarded)."""
        means = {
            key: sum(w * p[key].astype(np.float64) for w, p in zip(weights, payloads, strict=True))
            for key in new_As
        }
        policies = RANK_MISMATCH_POLICIES if self.fedavg_gap == "both" else (self.rank_mismatch,)
        out = {}
        for policy in policies:
            As = new_As if policy == self.rank_mismatch else self.server_step(
                payloads, weights, policy
            )[0]  # fmt: skip
            gaps = []
            for key, new in As.items():
                move = float(np.linalg.norm(new - self.global_state[key]))
                gaps.append(float(np.linalg.norm(new - means[key])) / move if move > 0 else np.nan)
            out[f"fedavg_gap_{policy}"] = float(np.nanmean(gaps)) if gaps else np.nan
        return out


def summarize_layers(
    per_layer: dict[str, dict[str, float]],
    names: tuple[str, ...] = ("rank", "gram_rel_error", "drift", "eigengap"),
) -> dict[str, float]:
    """Mean of each diagnostic over layers, plus the worst case (max / min) of each."""
    out: dict[str, float] = {}
    for name in names:
        values = np.array([float(info[name]) for info in per_layer.values()])
        out[name] = float(values.mean())
        worst = values.min() if name in ("rank", "eigengap") else values.max()
        out[f"{name}_{'min' if name in ('rank', 'eigengap') else 'max'}"] = float(worst)
    return out
