"""The StarPO-S learner: one data-parallel rank's actor (and critic) update on a batch shard.

A plain class: the single-process loop builds one directly, the Ray learner pool wraps one per rank
(``learner/actor.py``) after joining a torch.distributed group. Per step it

1. recomputes the learner's log-probs of the sampled tokens (the PPO "old"/proximal policy), the
   critic's values and, when a KL term is configured, the reference policy's log-probs;
2. computes advantages (GAE over sampled tokens, whitened over the *whole* batch with all-reduced
   moments; or GRPO group-normalised scores broadcast over the reply tokens);
3. runs epochs x mini-batches x micro-batches of the StarPO-S losses from ``algo``, dividing by the
   *global* token count so DDP's gradient average equals the single-process gradient;
4. clips gradients and skips an optimizer step whose gradient norm is not finite (counted);
5. advances ``policy_version`` by one: the version unit is the *learner step* (one consumed batch,
   however many optimizer mini-batch steps it takes), as AReaL counts and as admission, fixed-lag and
   every staleness metric assume.

Weights, gradients and optimizer state are fp32 masters; forwards compute in ``model.dtype``
(``learner/precision.py``). Data parallelism (DDP or per-layer FSDP2) is ``learner/parallel.py``; checkpoints
(model, critic, optimizers, version and RNG states) are ``learner/checkpoint.py``.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import math
import time
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from ragen_async import algo
from ragen_async.config import RunConfig
from ragen_async.learner import checkpoint, parallel, precision
from ragen_async.learner.batch import TokenBatch, collate_shard, pack_rows, split_even
from ragen_async.learner.flops import StepMeter
from ragen_async.protocol import BatchShard
from ragen_async.weight_sync.wire import flat_layout

log = logging.getLogger(__name__)

ADDITIVE_METRICS = frozenset({"actor/pg_loss", "actor/entropy", "actor/kl_loss", "critic/vf_loss",
                              "learner/num_tokens", "learner/padded_micro_batches"})
"""Metrics that are this rank's *share* of a global quantity (the losses were aggregated with the global
token/sequence count; ``learner/num_tokens`` counts this rank's trained tokens, ``learner/padded_micro_batches``
the empty micro-batches it ran to keep step with a rank that had more): sum them over ranks, so the merged
``learner/num_tokens`` is the batch's. Every other per-rank metric is a mean: average it."""



def merge_rank_metrics(per_rank: list[dict[str, float]]) -> dict[str, float]:
    """Sum the additive metrics over ranks, average the rest."""
    keys = set().union(*per_rank)
    out = {}
    for k in keys:
        vals = [m[k] for m in per_rank if k in m]
        out[k] = float(np.sum(vals)) if k in ADDITIVE_METRICS else float(np.mean(vals))
    return out


GATHER_BUCKET_BYTES = 256 * 2**20
"""Default bound on the full parameters one FSDP gather holds at once (:meth:`Learner.full_weight_buckets`)."""


@dataclass(frozen=True)
class UpdateTargets:
    """What one learner step's update trains toward, per token of the shard, fixed across its optimizer
    steps (rows and columns as in the shard's :class:`TokenBatch`)."""

    old_logprobs: torch.Tensor
    """The proximal policy's log-probs (PPO's ratio denominator); with ``fill_old`` written by the update's own
    first forward instead of read."""
    advantages: torch.Tensor
    old_values: torch.Tensor | None = None
    """The critic's values before the update (GAE); ``None`` without a critic."""
    returns: torch.Tensor | None = None
    """The critic's targets; ``None`` without a critic."""
    ref_logprobs: torch.Tensor | None = None
    """The reference policy's log-probs (KL penalty); ``None`` without one."""
    staleness: torch.Tensor | None = None
    """Each token's age in versions (this step's learner version minus the version that sampled it), which
    the ``age`` off-policy correction reads."""
    fill_old: bool = False


def flatten_parameters(module: torch.nn.Module) -> None:
    """Move ``module``'s parameters (tied ones once, in ``named_parameters`` order) into one flat buffer
    per dtype, in place: the ``Parameter`` objects stay (build optimizers after or before, either works),
    their data become views. The learner does this so a publish sends its live weights without a copy."""
    params = [p for _, p in module.named_parameters()]
    with torch.no_grad():
        for p, view in zip(params, flat_layout([p.data for p in params]), strict=True):
            p.data = view


@dataclass(frozen=True)
class _Micro:
    """One micro-batch of an optimizer step, as every pass over it sees it."""

    mb: TokenBatch
    """Its rows of the step's batch, trimmed to their longest."""
    rows: torch.Tensor
    """Their indices in the step's batch (on the device)."""
    zero: float
    """0.0 for a padded micro-batch (a rank with no rows there runs one row at weight 0), else 1.0."""
    last: bool
    """The mini-batch's last: where DDP synchronises gradients."""

    @property
    def T(self) -> int:  # noqa: N802 (the batch's column count, as everywhere in the learner)
        return int(self.mb.input_ids.shape[1])

    @property
    def weight(self) -> float:
        """Trained tokens, the weight of its mean metrics (0 when padded)."""
        return float(self.mb.num_trained) * self.zero


@dataclass(frozen=True)
class TrainResult:
    """What one learner step returns: the new policy version, apart from the step's metrics."""

    version: int
    metrics: dict[str, float]


def _check_model_path(path: str) -> Path:
    p = Path(path)
    if not (p / "config.json").is_file():
        raise FileNotFoundError(
            f"model.path={path!r} is not a model directory (no config.json). Build the tiny model with "
            f"`ragen-async make-model` or point model.path at a local Hugging Face checkpoint.")
    return p


def load_actor(path: str, dtype: torch.dtype = precision.MASTER_DTYPE) -> nn.Module:
    """The policy from ``path``, its weights in ``dtype`` (the learner's fp32 masters by default)."""
    from transformers import AutoModelForCausalLM

    _check_model_path(path)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype)


def load_critic(path: str, dtype: torch.dtype = precision.MASTER_DTYPE) -> nn.Module:
    """A value model from the same base as the actor (RAGEN): the LM body with a 1-output head, without
    dropout before the head (set in the config it is built from: Transformers' default is 0.1, which in
    train mode would make the values random)."""
    from transformers import AutoConfig, AutoModelForTokenClassification

    _check_model_path(path)
    config = AutoConfig.from_pretrained(path, num_labels=1)
    config.classifier_dropout = 0.0
    return AutoModelForTokenClassification.from_pretrained(path, config=config, dtype=dtype)


class TokenLogits(nn.Module):
    """A causal LM that computes logits only where asked: the body runs on the whole batch, the
    vocabulary head only on the positions in ``flat_index`` (row-major over [B, T]), and there
    ``chunk_tokens`` positions at a time (:func:`algo.head_logprobs_entropy`), reduced at once to the
    log-prob of the target token and the entropy. Sampled tokens are a small share of a multi-turn
    episode (about 10 % on Sokoban), and at paper scale the [positions, vocabulary] fp32 logits are the
    largest tensors of the step. Wrapped by DDP/FSDP as a whole, so gradient synchronisation sees one
    forward."""

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm

    def forward(self, input_ids: torch.Tensor, flat_index: torch.Tensor, targets: torch.Tensor, *,
                temperature: float = 1.0, chunk_tokens: int | None = None,
                with_entropy: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(logprobs [N], entropy [N] or None)`` of ``targets`` at the positions ``flat_index``."""
        # Right padding under causal attention needs no attention mask: no real token sees a pad. The KV cache (the
        # config's default) stays on, though it copies each layer's keys and values for nothing: without a cache and
        # a mask, Transformers (5.19) looks for packed sequences in the position ids, a read of the device per
        # forward (a GPU synchronisation; tests/learner/test_devices.py); dropping the cache saved about 2 % of
        # a CPU step, within the noise.
        hidden = self.lm.base_model(input_ids=input_ids).last_hidden_state
        return algo.head_logprobs_entropy(self.lm.get_output_embeddings(), hidden.flatten(0, 1)[flat_index], targets,
                                          temperature=temperature, chunk_tokens=chunk_tokens,
                                          with_entropy=with_entropy)


def _shifted(values_for_next_token: torch.Tensor) -> torch.Tensor:
    """Align per-position outputs with tokens: entry t of the result belongs to token t, which was
    predicted from position t-1. Token 0 (no prefix) gets 0; it is never a sampled token."""
    return torch.nn.functional.pad(values_for_next_token[:, :-1], (1, 0))


class Learner:
    critic_values_from_update: bool = True
    """With one update per step (one epoch, one mini-batch), the critic's old values are its update's own forwards
    (detached), run before the actor's, instead of a separate no-grad pass: the same numbers, one critic forward
    fewer. ``False`` keeps the separate pass (the reference the tests compare with)."""

    def __init__(self, cfg: RunConfig, *, rank: int = 0, world_size: int = 1, device: str = "cpu"):
        self.cfg = cfg
        self.rank, self.world_size = rank, world_size
        self.distributed = world_size > 1
        # FSDP: each rank holds shards (DTensors) of the actor's and critic's parameters.
        self.sharded = self.distributed and cfg.learner.strategy == "fsdp"
        if self.distributed and not dist.is_initialized():
            raise RuntimeError("world_size > 1 needs torch.distributed initialised before building the Learner")
        self.device = torch.device(device)
        torch.manual_seed(cfg.learner.seed)
        self.temperature = cfg.rollout.temperature
        self.algo_cfg = cfg.algo
        # fp32 masters (weights, gradients, optimizer state, checkpoints); compute in model.dtype.
        self.compute_dtype = precision.compute_dtype(cfg.model.dtype, self.device)
        self.engine_dtype = precision.DTYPES[cfg.model.dtype]

        self.actor = load_actor(cfg.model.path).to(self.device)
        if self.device.type == "cpu" and cfg.learner.strategy != "fsdp":
            flatten_parameters(self.actor)  # one buffer per dtype: the gloo publish sends it without a copy
        if cfg.model.gradient_checkpointing:
            self.actor.gradient_checkpointing_enable()
        self.pad_id = self.actor.config.pad_token_id or 0
        self.critic = (load_critic(cfg.model.critic_path or cfg.model.path).to(self.device)
                       if cfg.algo.use_critic else None)
        self.ref = None
        if cfg.algo.use_ref:
            self.ref = copy.deepcopy(self.actor).eval().requires_grad_(False)

        self.compute_bits = 0.0
        """Bits per value of the last actor forward's matmul outputs (``learner/compute_bits``): the dtype the
        learner actually computed in, seen by a hook on the actor's first linear layer."""
        first_linear = next(m for m in self.actor.modules() if isinstance(m, nn.Linear))
        first_linear.register_forward_hook(self._record_compute_bits)

        self.actor_head = TokenLogits(self.actor)
        self.actor_ddp = self._wrap(self.actor_head)
        self.critic_ddp = self._wrap(self.critic) if self.critic is not None else None
        lc = cfg.learner
        self.actor_opt = torch.optim.AdamW(self.actor.parameters(), lr=lc.actor_lr, betas=lc.betas,
                                           weight_decay=lc.weight_decay)
        self.critic_opt = (torch.optim.AdamW(self.critic.parameters(), lr=lc.critic_lr, betas=lc.betas,
                                             weight_decay=lc.weight_decay) if self.critic is not None else None)
        self.policy_version = 0
        self.skipped_steps = 0
        self._probe_model: nn.Module | None = None
        """An unsharded copy of the actor for probing older weights (fixed lag); built on first use."""
        self.flops = StepMeter(self)
        """This rank's model FLOPs per step and MFU (``learner/flops.py``: torchtitan's count, a named peak)."""

    def _record_compute_bits(self, _module: nn.Module, _inputs: Any, output: torch.Tensor) -> None:
        self.compute_bits = float(output.dtype.itemsize * 8)

    def _wrap(self, model: nn.Module) -> nn.Module:
        if not self.distributed:
            return model
        return parallel.wrap(model, self.cfg.learner.strategy, self.compute_dtype)

    # ------------------------------------------------------------------ forward passes
    def _policy_forward(self, model: nn.Module, mb: TokenBatch, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """[B, T] log-probs (and entropies) of the trained tokens (loss mask 1); 0 elsewhere. ``model``
        is a :class:`TokenLogits` (or its DDP/FSDP wrapper)."""
        ids = mb.input_ids
        B, T = ids.shape
        # Token t (t >= 1) is scored at position t - 1, i.e. flat index b*T + t - 1. Planned on the
        # host (mb.trained), so the device never has to report how many tokens are trained.
        trained = mb.trained.copy()
        trained[:, 0] = False
        token_index = torch.as_tensor(np.flatnonzero(trained), device=self.device)
        with self._autocast(model):
            logprobs, entropy = model(ids, token_index - 1, ids.flatten()[token_index], temperature=self.temperature,
                                      chunk_tokens=self.cfg.learner.logits_chunk_tokens, with_entropy=with_entropy)
        logprobs = logprobs.new_zeros(B * T).index_copy(0, token_index, logprobs).view(B, T)
        if entropy is None:
            return logprobs, None
        return logprobs, entropy.new_zeros(B * T).index_copy(0, token_index, entropy).view(B, T)

    def _value_forward(self, model: nn.Module, mb: TokenBatch) -> torch.Tensor:
        # Right padding under causal attention needs no attention mask; the KV cache stays on (see TokenLogits).
        with self._autocast(model):
            values = model(input_ids=mb.input_ids).logits
        return _shifted(values.float().squeeze(-1))

    def _autocast(self, model: nn.Module | None = None):
        """Compute ``model``'s forward (by default the actor's) in ``compute_dtype`` over the fp32 masters:
        autocast for a single process, DDP and what FSDP does not shard (the reference model, an unsharded
        copy); an FSDP module's mixed-precision policy gathers its parameters in that dtype already."""
        if isinstance(model if model is not None else self.actor_head, FSDPModule):
            return contextlib.nullcontext()
        return precision.autocast(self.device, self.compute_dtype)

    def _micro_rows(self, batch: TokenBatch) -> list[np.ndarray]:
        """Row indices (host) of each micro-batch (``micro_batch_size`` rows, ``micro_batch_tokens`` padded tokens)."""
        lc = self.cfg.learner
        return [np.array(rows, dtype=np.int64)
                for rows in pack_rows(batch.lengths.tolist(), lc.micro_batch_size, lc.micro_batch_tokens)]

    def _max_over_ranks(self, n: int) -> int:
        """The largest ``n`` of any rank (a collective when distributed)."""
        if not self.distributed:
            return n
        t = torch.tensor([n], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(self._fetch(t)[0])

    def _padded(self, groups: list[np.ndarray]) -> list[np.ndarray | None]:
        """``groups`` then ``None`` (a micro-batch with nothing to train) until every rank has as many
        as the rank with the most. Shards are balanced by tokens, not rows, so ranks pack different
        numbers of micro-batches; every forward and backward of a wrapped model is a collective (FSDP
        gathers and reduce-scatters each one; DDP syncs buffers), so each rank must run the same
        number or the group hangs until its timeout."""
        return [*groups, *[None] * (self._max_over_ranks(len(groups)) - len(groups))]

    @torch.no_grad()
    def _recompute(self, batch: TokenBatch, logprobs: bool = True, values: bool = True) -> dict[str, torch.Tensor]:
        """Learner log-probs (old/proximal; with ``logprobs``), critic values (with ``values``) and reference
        log-probs."""
        values = values and self.critic is not None
        if not (logprobs or values or self.ref is not None):
            return {}
        T = batch.input_ids.shape[1]
        out: dict[str, list[torch.Tensor]] = defaultdict(list)
        groups = self._micro_rows(batch)
        # Under FSDP each forward gathers: a rank with fewer micro-batches runs throwaway ones.
        dummies = len(self._padded(groups)) - len(groups) if self.sharded else 0
        for _ in range(dummies):
            self._throwaway_forward(batch, logprobs, values)
        for rows in groups:
            mb = batch.select(rows).trimmed()
            pad = (0, T - mb.input_ids.shape[1])
            if logprobs:
                out["old_logprobs"].append(torch.nn.functional.pad(self._policy_forward(self.actor_head, mb, False)[0], pad))
            if values:
                out["old_values"].append(torch.nn.functional.pad(self._value_forward(self.critic, mb), pad))
            if self.ref is not None:
                out["ref_logprobs"].append(torch.nn.functional.pad(self._policy_forward(TokenLogits(self.ref), mb, False)[0], pad))
        # Back to the batch's row order.
        inverse = np.argsort(np.concatenate(groups)) if groups else np.zeros(0, dtype=np.int64)
        inverse_t = torch.as_tensor(inverse, device=self.device)
        self._reshard()  # FSDP keeps the root units gathered after a forward without backward: free them
        return {k: torch.cat(v)[inverse_t] for k, v in out.items()}

    def _throwaway_forward(self, batch: TokenBatch, logprobs: bool, values: bool) -> None:
        """The forwards of :meth:`_recompute` on one row, results dropped: this rank's share of the
        collectives of a micro-batch it does not have."""
        mb = batch.select(np.arange(min(batch.size, 1))).trimmed()
        if logprobs:
            self._policy_forward(self.actor_head, mb, False)
        if values:
            self._value_forward(self.critic, mb)

    # ------------------------------------------------------------------ collectives and host reads
    def _all_reduce_sum(self, *values: torch.Tensor | float) -> list[torch.Tensor]:
        """Float64 sums over ranks, as tensors on the learner's device (NCCL only reduces device tensors)."""
        t = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=self.device) for v in values])
        if self.distributed:
            dist.all_reduce(t)
        return list(t.unbind())

    def _fetch(self, values: torch.Tensor) -> list[float]:
        """The one device-to-host read: every value the learner brings back from the device (the
        finite-gradient check, the metrics, probe log-probs) goes through here, so nothing else
        synchronises with the device (and a test can run the step on a data-less device)."""
        return values.detach().double().flatten().tolist()

    def _to_host(self, values: dict[str, torch.Tensor]) -> dict[str, float]:
        """Scalar device tensors -> floats, in one transfer."""
        if not values:
            return {}
        host = self._fetch(torch.stack([v.detach().double().reshape(()) for v in values.values()]))
        return dict(zip(values, host, strict=True))

    # ------------------------------------------------------------------ advantages
    def _advantages(self, batch: TokenBatch, old_values: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        a = self.algo_cfg
        mask = batch.loss_mask
        if a.adv_estimator == "grpo":
            return algo.broadcast_to_tokens(batch.normalized_scores, mask), None
        assert old_values is not None
        rewards = algo.scores_to_token_rewards(batch.scores, mask)
        advantages, returns = algo.compute_gae(rewards, old_values, mask, a.gamma, a.gae_lambda)
        if a.whiten_advantages:
            total, total_sq, count = self._all_reduce_sum(*algo.masked_moments(advantages.double(), mask.double()))
            mean, var = algo.moments_to_mean_var(total, total_sq, count)
            advantages = algo.masked_whiten(advantages, mask, stats=(mean.float(), var.float()))
        return advantages, returns

    # ------------------------------------------------------------------ the step
    def train_step(self, shard: BatchShard) -> TrainResult:
        """One learner step on this rank's shard: the new version and this rank's metrics (plain floats)."""
        lc = self.cfg.learner
        t0 = time.perf_counter()
        batch = collate_shard(shard, self.pad_id, self.device)
        self.actor.train()
        # Every rank derives the mini-batch count from global numbers so all ranks step together.
        n_mini = max(1, round(shard.batch_num_seqs / lc.mini_batch_size))
        # With one update on the whole shard, the policy before it is the one the update's own forward
        # sees: its detached log-probs are the old (proximal) ones, filled in by _optimizer_step, and the
        # separate no-grad pass of the actor is skipped.
        single_pass = lc.epochs == 1 and n_mini == 1
        # Likewise the critic's values before the update are its update's own forwards: they run first (every
        # row's value is needed for the advantages), each micro-batch's loss and backward at once (its returns
        # are its own rows' GAE), and the critic's optimizer step waits for the actor's backwards.
        values_in_update = single_pass and self.critic is not None and self.critic_values_from_update
        t1 = time.perf_counter()
        recomputed = self._recompute(batch, logprobs=not single_pass, values=not values_in_update)
        t2 = time.perf_counter()
        old_logprobs = torch.zeros_like(batch.behaviour_logprobs) if single_pass else recomputed["old_logprobs"]
        critic_sums, critic_first_s = None, 0.0  # the critic's part of the update, timed with the update
        if values_in_update:
            old_values = torch.zeros_like(batch.behaviour_logprobs)
            critic_sums = self._critic_first(batch, old_values)
            critic_first_s = time.perf_counter() - t2
        else:
            old_values = recomputed.get("old_values")
        advantages, returns = self._advantages(batch, old_values)

        # Metrics stay device tensors (float64 where they are sums) until one _to_host at the end.
        on_device: dict[str, torch.Tensor] = {}
        if old_values is not None and returns is not None:
            # Over the whole shard (verl: pre-update values); undefined (NaN, dropped) when every
            # return is the same.
            explained = algo.explained_variance(old_values, returns, batch.loss_mask)
            on_device["critic/vf_explained_var"] = torch.where(
                algo.masked_var(returns, batch.loss_mask) > 1e-8, explained, torch.full_like(explained, math.nan))

        staleness = self._staleness(batch, shard.learner_version)
        targets = UpdateTargets(old_logprobs, advantages, old_values, returns, recomputed.get("ref_logprobs"),
                                staleness=staleness, fill_old=single_pass)
        sums: dict[str, torch.Tensor | float] = defaultdict(float)
        n_steps = 0
        t3 = time.perf_counter()
        for _epoch in range(lc.epochs):
            for mini in split_even(batch.size, n_mini):
                step_metrics = self._optimizer_step(batch, mini, targets, critic_sums)
                for k, v in step_metrics.items():
                    sums[k] += v
                n_steps += 1
        t4 = time.perf_counter()
        lag_sums = self._lag_sums(batch, old_logprobs, advantages, staleness)
        on_device.update({f"_lag/{i}": v for i, v in enumerate(lag_sums.flatten().unbind())})
        averaged = {k: v / n_steps for k, v in sums.items()}
        on_device.update({k: v for k, v in averaged.items() if isinstance(v, torch.Tensor)})
        metrics = self._to_host(on_device)
        metrics.update({k: v for k, v in averaged.items() if not isinstance(v, torch.Tensor)})
        if math.isnan(metrics.get("critic/vf_explained_var", 0.0)):
            del metrics["critic/vf_explained_var"]
        flat, k = [metrics.pop(f"_lag/{i}") for i in range(lag_sums.numel())], self.LAG_BUCKETS
        metrics.update(algo.lag_metrics([flat[r * k:(r + 1) * k] for r in range(len(algo.LAG_SUMS))],
                                        correction=self.algo_cfg.off_policy != "none"))
        metrics.update({"timing/learner_collate_s": t1 - t0, "timing/learner_recompute_s": t2 - t1,
                        "timing/learner_advantages_s": t3 - t2 - critic_first_s,
                        "timing/learner_update_s": t4 - t3 + critic_first_s})
        metrics["actor/skipped_steps"] = float(self.skipped_steps)
        metrics["learner/optimizer_steps"] = float(n_steps)
        metrics["learner/compute_bits"] = self.compute_bits
        metrics["learner/num_tokens"] = float(batch.num_trained)
        metrics.update(self.flops.metrics(batch.lengths, old_logprobs=not single_pass, seconds=time.perf_counter() - t0))
        self.policy_version += 1
        return TrainResult(self.policy_version, metrics)

    def _micro_batches(self, batch: TokenBatch, mini: slice) -> tuple[list[_Micro], float, list[torch.Tensor]]:
        """Mini-batch ``mini``'s micro-batches (padded to the count of the rank with the most), this rank's trained
        tokens in it and the global ``[tokens, sequences]`` the losses divide by."""
        mb_all = batch.select(mini)
        idx = np.arange(batch.size)[mini]
        local_tokens = float(mb_all.num_trained)
        # The seq-mean modes average over rows with a trained token: a row with none is not a sequence there.
        local_seqs = float(mb_all.trained.any(axis=1).sum())
        counts = self._all_reduce_sum(local_tokens, local_seqs)
        groups = self._padded(self._micro_rows(mb_all)) or [None]
        micros = []
        for i, local_rows in enumerate(groups):
            host_rows = idx[local_rows] if local_rows is not None else idx[:0]
            empty = host_rows.size == 0
            if empty:
                # This rank has no rows in this micro-batch but every rank must run the same forwards
                # and backwards (collectives under DDP and FSDP): run one row with zero weight.
                host_rows = idx[:1] if idx.size else np.arange(1)
            micros.append(_Micro(mb=batch.select(host_rows).trimmed(), rows=torch.as_tensor(host_rows, device=self.device),
                                 zero=0.0 if empty else 1.0, last=i == len(groups) - 1))
        return micros, local_tokens, counts

    def _critic_backward(self, u: _Micro, old_values: torch.Tensor, returns: torch.Tensor | None,
                         counts: list[torch.Tensor], sums: dict[str, torch.Tensor | float],
                         fill_from: TokenBatch | None = None) -> None:
        """The critic's forward, loss and backward on micro-batch ``u``, its metrics added to ``sums``. With
        ``fill_from`` (the step's batch, one update per step) its detached values are the old ones: written into
        ``old_values`` first, and the returns its loss needs are its rows' GAE from them (GAE runs within a row,
        here over the row's full width, as on the whole batch)."""
        a = self.algo_cfg
        with self._no_sync(self.critic_ddp, u.last):
            values = self._value_forward(self.critic_ddp, u.mb)
            if fill_from is not None:
                if u.zero:
                    old_values[u.rows, :u.T] = values.detach()
                mask = fill_from.loss_mask[u.rows]
                _, returns_rows = algo.compute_gae(algo.scores_to_token_rewards(fill_from.scores[u.rows], mask),
                                                   old_values[u.rows], mask, a.gamma, a.gae_lambda)
                returns_mb = returns_rows[:, :u.T]
            else:
                returns_mb = returns[u.rows, :u.T]
            vloss, vm = algo.value_loss(values, old_values[u.rows, :u.T], returns_mb, u.mb.loss_mask * u.zero,
                                        clip_range_value=a.clip_range_value, loss_agg_mode=a.loss_agg_mode,
                                        num_tokens=counts[0], num_seqs=counts[1])
            (vloss * float(self.world_size)).backward()
        for k, v in vm.items():
            key = f"critic/{k}"
            sums[key] += v.detach().double() * (u.zero if key in ADDITIVE_METRICS else u.weight)

    def _critic_first(self, batch: TokenBatch, old_values: torch.Tensor) -> dict[str, torch.Tensor | float]:
        """One update per step: the critic's forwards and backwards of the step's one optimizer step, before the
        actor's, their detached values written into ``old_values`` (the values before the update: the critic
        has not stepped yet). Its gradients wait in ``.grad`` for :meth:`_optimizer_step`; returns its metric
        sums."""
        micros, _, counts = self._micro_batches(batch, slice(0, batch.size))
        self.critic_opt.zero_grad(set_to_none=True)
        sums: dict[str, torch.Tensor | float] = defaultdict(float)
        for u in micros:
            self._critic_backward(u, old_values, None, counts, sums, fill_from=batch)
        return sums

    def _optimizer_step(self, batch: TokenBatch, mini: slice, targets: UpdateTargets,
                        critic_sums: dict[str, torch.Tensor | float] | None = None) -> dict[str, torch.Tensor | float]:
        """One optimizer step on mini-batch ``mini`` of ``batch`` toward ``targets`` (with ``targets.fill_old``
        the old log-probs are written here from this step's own pre-update forward instead of read). With
        ``critic_sums`` the critic's backwards have run already (:meth:`_critic_first`): only its step is left."""
        a, t = self.algo_cfg, targets
        old_logprobs, advantages, ref_logprobs = t.old_logprobs, t.advantages, t.ref_logprobs
        micros, local_tokens, counts = self._micro_batches(batch, mini)
        global_tokens, global_seqs = counts
        # DDP averages gradients over ranks; scaling by world_size turns that average into the sum
        # of per-rank contributions, each already normalised by the global count.
        scale = float(self.world_size)

        self.actor_opt.zero_grad(set_to_none=True)
        if self.critic_opt is not None and critic_sums is None:
            self.critic_opt.zero_grad(set_to_none=True)
        # Per-micro-batch metrics are accumulated on the device in float64 (what Python floats did).
        sums: dict[str, torch.Tensor | float] = defaultdict(float)
        for u in micros:
            mb, rows, T, zero = u.mb, u.rows, u.T, u.zero
            with self._no_sync(self.actor_ddp, u.last):
                logprobs, entropy = self._policy_forward(self.actor_ddp, mb, with_entropy=True)
                if t.fill_old and zero:
                    old_logprobs[rows, :T] = logprobs.detach()
                pg_inputs = algo.PolicyLossInputs(
                    logprobs=logprobs, old_logprobs=old_logprobs[rows, :T], advantages=advantages[rows, :T],
                    mask=mb.loss_mask * zero, behaviour_logprobs=mb.behaviour_logprobs, entropy=entropy,
                    ref_logprobs=ref_logprobs[rows, :T] if ref_logprobs is not None else None,
                    staleness=t.staleness[rows, :T] if t.staleness is not None else None)
                loss, m = algo.policy_loss(
                    pg_inputs, clip_eps_low=a.clip_eps_low, clip_eps_high=a.clip_eps_high,
                    dual_clip_c=a.dual_clip_c, loss_agg_mode=a.loss_agg_mode, off_policy=a.off_policy,
                    is_cap=a.is_cap, **self._correction_kwargs(), entropy_coef=a.entropy_coef, kl_coef=a.kl_coef,
                    kl_type=a.kl_type,
                    num_tokens=global_tokens, num_seqs=global_seqs)
                (loss * scale).backward()
            for k, v in m.items():
                key = f"actor/{k}"
                sums[key] += v.detach().double() * (zero if key in ADDITIVE_METRICS else u.weight)
            if self.critic_ddp is not None and critic_sums is None:
                self._critic_backward(u, t.old_values, t.returns, counts, sums)
        sums.update(critic_sums or {})
        # Additive metrics are already this rank's share of the mini-batch value; the others are
        # token-weighted means over micro-batches.
        local_w = max(local_tokens, 1e-9)
        metrics = {k: (v if k in ADDITIVE_METRICS else v / local_w) for k, v in sums.items()}
        metrics["learner/micro_batches"] = float(len(micros))  # every rank runs as many (padded)
        metrics["learner/padded_micro_batches"] = float(sum(u.zero == 0.0 for u in micros))
        metrics["actor/grad_norm"] = self._clip_and_step(self.actor, self.actor_opt, count_skips=True)
        if self.critic_opt is not None:
            metrics["critic/grad_norm"] = self._clip_and_step(self.critic, self.critic_opt, count_skips=False)
        return metrics

    def _clip_and_step(self, model: nn.Module, opt: torch.optim.Optimizer, count_skips: bool) -> float:
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), self.cfg.learner.grad_clip)
        if isinstance(norm, DTensor):  # FSDP: sharded gradients give a partial norm; make it the global one
            norm = norm.full_tensor()
        norm = self._to_host({"grad_norm": norm})["grad_norm"]  # the step depends on it: one read per step
        if math.isfinite(norm):
            opt.step()
            opt.zero_grad(set_to_none=True)  # free the fp32 gradients until the next step's backward
        else:
            # A non-finite gradient would poison the weights (and, via the engines, the rollouts).
            opt.zero_grad(set_to_none=True)
            if count_skips:
                self.skipped_steps += 1
            log.warning("non-finite gradient norm (%s): optimizer step skipped", norm)
        return norm

    @staticmethod
    def _no_sync(model: nn.Module, last: bool):
        if not last and hasattr(model, "no_sync"):
            return model.no_sync()
        return contextlib.nullcontext()

    LAG_BUCKETS = 9
    """Staleness buckets of the stability-by-lag metrics: lags 0..7 and "8 or more"."""

    @staticmethod
    def _staleness(batch: TokenBatch, learner_version: int) -> torch.Tensor:
        """[B, T] each token's age in versions at this step (0 off the loss mask and for future versions)."""
        return (learner_version - batch.token_versions).clamp(min=0)

    def _correction_kwargs(self) -> dict[str, Any]:
        """The off-policy correction's bounds, as ``algo.policy_loss`` and ``algo.off_policy_correction`` take them."""
        a = self.algo_cfg
        return {"opsm_delta": a.opsm_delta, "geo_cap": a.geo_cap, "age_tau": a.age_tau,
                "age_negatives_only": a.age_negatives_only}

    def _lag_sums(self, batch: TokenBatch, old_logprobs: torch.Tensor, advantages: torch.Tensor,
                  staleness: torch.Tensor) -> torch.Tensor:
        """The sums behind the stability-by-lag metrics (``algo.lag_sums``) over the whole step's
        batch, all ranks' combined, so every rank reports the same values. With an off-policy correction,
        what it did per lag: the weights of ``algo.off_policy_correction`` on the same tokens, advantages,
        pre-update log-probs and ages the loss saw (a trajectory is never split across micro-batches, so the
        sequence-level modes see the same rows)."""
        a = self.algo_cfg
        correction = None
        if a.off_policy != "none":
            correction = algo.off_policy_correction(
                a.off_policy, old_logprobs=old_logprobs, behaviour_logprobs=batch.behaviour_logprobs,
                advantages=advantages, mask=batch.loss_mask, staleness=staleness, is_cap=a.is_cap,
                **self._correction_kwargs())
        sums = algo.lag_sums(batch.loss_mask, staleness, batch.behaviour_logprobs, old_logprobs, advantages,
                             batch.scores, batch.successes, self.LAG_BUCKETS,
                             self.algo_cfg.clip_eps_low, self.algo_cfg.clip_eps_high, correction=correction)
        if self.distributed:
            dist.all_reduce(sums)
        return sums

    @torch.no_grad()
    def probe_logprobs(self, token_ids: list[int], temperature: float = 1.0,
                       weights: dict[str, torch.Tensor] | None = None) -> list[float]:
        """Log-prob of each token of a fixed sequence given its prefix (position 0 gets 0.0): the
        learner's side of the engine/learner agreement check. Through :class:`TokenLogits`, so a long
        sequence's logits are computed in chunks as in training. ``weights`` (full tensors in Hugging
        Face naming, e.g. an older version kept for fixed lag): computed with those instead, in a
        separate unsharded copy of the actor (loaded once, then overwritten each time)."""
        head, compute = self.actor_head, self._autocast(self.actor_head)
        if weights is not None:
            compute = precision.autocast(self.device, self.compute_dtype)  # an unsharded copy: autocast
            if self._probe_model is None:
                self._probe_model = load_actor(self.cfg.model.path).to(self.device).eval()
            missing, unexpected = self._probe_model.load_state_dict(weights, strict=False)
            tied = {"lm_head.weight"} if self._probe_model.config.tie_word_embeddings else set()
            if set(missing) - tied or unexpected:
                raise ValueError(f"probe weights do not fit the actor: missing {missing}, unexpected {unexpected}")
            head = TokenLogits(self._probe_model)
        ids = torch.tensor([token_ids], device=self.device)
        positions = torch.arange(ids.shape[1] - 1, device=self.device)
        with compute:
            logprobs, _ = head(ids, positions, ids[0, 1:], temperature=temperature,
                               chunk_tokens=self.cfg.learner.logits_chunk_tokens)
        return [0.0] + self._fetch(logprobs)

    # ------------------------------------------------------------------ weights and checkpoints
    def named_weights(self) -> list[tuple[str, torch.Tensor]]:
        """Actor weights in checkpoint (Hugging Face) naming and the engines' dtype (``model.dtype``),
        for publishing: the live fp32 masters when that is float32 (no copy), else copies. Under FSDP a
        rank holds only shards: use :meth:`full_weights` there."""
        if self.sharded:
            raise RuntimeError("named_weights(): under FSDP the actor's parameters are shards; call "
                               "full_weights() on every rank (a collective) and publish rank 0's result")
        return [(name, precision.engine_copy(p.detach(), self.engine_dtype)) for name, p in self.actor.named_parameters()]

    def full_weight_buckets(self, bucket_bytes: int = GATHER_BUCKET_BYTES) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """The actor's weights as full tensors in Hugging Face naming, one bucket at a time: consecutive
        parameters of at most ``bucket_bytes`` in all (a larger parameter is a bucket alone).

        Under FSDP this is a collective: every rank must run it to the end, in the same order. Each
        bucket is all-gathered (``DTensor.full_tensor``), so at most one bucket of full parameters exists
        on the device at a time; rank 0 (the publisher) gets it moved to the CPU, the other ranks get an
        empty list and drop their copy. Without FSDP no collective runs: the buckets are the live
        parameters (:meth:`named_weights`)."""
        self._reshard()
        bucket: list[tuple[str, torch.Tensor]] = []
        size = 0
        for name, p in self.actor.named_parameters():
            nbytes = p.numel() * p.element_size()
            if bucket and size + nbytes > bucket_bytes:
                yield self._gather(bucket)
                bucket, size = [], 0
            bucket.append((name, p.detach()))
            size += nbytes
        if bucket:
            yield self._gather(bucket)

    def _reshard(self) -> None:
        """FSDP leaves the root module's parameters gathered after a forward without backward (the
        probe, the no-grad recompute), registered as plain tensors that the optimizer does not know:
        register the shards again before reading or loading parameters. Local, not a collective."""
        if self.sharded:
            for model in (self.actor_head, self.critic):
                if isinstance(model, FSDPModule):
                    model.reshard()

    def _gather(self, bucket: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        if not self.sharded:
            return [(name, precision.engine_copy(p, self.engine_dtype)) for name, p in bucket]
        with torch.no_grad():
            full = [(name, p.full_tensor()) for name, p in bucket]
        return [(name, precision.engine_copy(t, self.engine_dtype).cpu()) for name, t in full] if self.rank == 0 else []

    def full_weights(self, bucket_bytes: int = GATHER_BUCKET_BYTES) -> list[tuple[str, torch.Tensor]]:
        """All of :meth:`full_weight_buckets`: under FSDP a collective that returns the full weights on
        rank 0 (CPU tensors) and an empty list on the other ranks; otherwise :meth:`named_weights`."""
        return [item for bucket in self.full_weight_buckets(bucket_bytes) for item in bucket]

    def save_checkpoint(self, path: Path, extra: dict | None = None, write_weights: bool = True) -> None:
        """Write this rank's part of a checkpoint (``learner/checkpoint.py``: the actor, the shared state on
        rank 0, each rank's version and RNG). Under FSDP a collective (every rank takes part in the gathers);
        otherwise the ranks need not call it together. The caller waits for every rank's save before
        finalising the checkpoint."""
        checkpoint.save(self, path, extra, write_weights)

    def load_checkpoint(self, path: Path) -> dict:
        """Restore a checkpoint written under any strategy and rank count; returns its ``extra``. With several
        ranks a collective: rank 0 reads the shared files and broadcasts them (sharding them under FSDP)."""
        return checkpoint.load(self, path)

    def _all_gather(self, obj) -> list:
        """Every rank's ``obj``, in rank order."""
        if not self.distributed:
            return [obj]
        out: list = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out
