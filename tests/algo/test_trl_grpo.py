"""Our GRPO loss and group-normalised advantages against TRL's GRPOTrainer on identical inputs.

TRL's own code computes its side: the loss through ``GRPOTrainer._compute_loss`` on a minimal trainer (the tiny
model, offline), with only the model's forward replaced by the given per-token log-probs and entropies; the
advantages through ``GRPOTrainer._generate_and_score_completions``, fed fixed completions by a ``rollout_func`` and
fixed scores by a reward function. Token by token means: each loss token isolated by a one-hot ``tool_mask`` (TRL's
multi-turn mask, ``env_mask`` of a ``rollout_func``), and the gradient of the whole batch's loss with respect to
every token's log-prob.

Where the two are meant to agree (``bench peer`` runs them so): our ``token-mean`` is TRL's ``bnpo`` (and ``dapo``
with the batch's token count as ``num_items_in_batch``), ``seq-mean-token-mean`` its ``grpo``; our dual clip c is
TRL's two-sided clip ``delta``; clip 0.2 / 0.28 is ``epsilon`` / ``epsilon_high``; the entropy bonus is
``entropy_coef`` in both. TRL divides by ``std + 1e-4`` where we divide by ``std + 1e-6``: the advantages agree to
``1e-4 / std`` relative.

TRL is the ``peer`` extra (also in ``dev``); without it these tests fail, saying how to install it.
"""

from __future__ import annotations

import pytest
import torch
from torch.testing import assert_close

from ragen_async.algo.advantages import group_normalize
from ragen_async.algo.losses import PolicyLossInputs, policy_loss

INSTALL = "TRL is missing: pip install -e '.[peer]' (or '.[dev]'), the pinned trl the cross-check needs"
B, T, GROUP = 6, 7, 3
"""Sequences, completion positions and group size of the fixture batch (two groups of three)."""


def _trl():
    try:
        import trl
    except ImportError as e:  # never skipped: a missing peer is a failure that says how to fix it
        pytest.fail(f"{INSTALL} ({e})", pytrace=False)
    return trl


@pytest.fixture(scope="module")
def make_trainer(tiny_model_path, tmp_path_factory):
    """``make_trainer(**config)``: a GRPOTrainer on the tiny model whose forward returns ``trainer.fixed``."""
    _trl()
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    class FixedForward(GRPOTrainer):
        fixed: tuple[torch.Tensor, torch.Tensor]

        def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, *args,
                                               **kwargs):
            logps, entropies = self.fixed
            return logps, entropies, None

    def rollout(prompts, trainer):
        # Fixed completions (the advantage test's): one per prompt, the score of row i is prompts[i]'s.
        return {"prompt_ids": [[5, 6]] * len(prompts), "completion_ids": [[7, 8, 2]] * len(prompts),
                "logprobs": None, "score": [float(p) for p in prompts]}

    def score(prompts, completions, **kwargs):
        return kwargs["score"]

    out = tmp_path_factory.mktemp("trl")

    def make(**overrides) -> GRPOTrainer:
        args = dict(output_dir=str(out), use_cpu=True, report_to="none", per_device_train_batch_size=B,
                    num_generations=GROUP, max_completion_length=T, learning_rate=1e-4, beta=0.0,
                    epsilon=0.2, epsilon_high=0.28, loss_type="bnpo", save_strategy="no", logging_strategy="no")
        args.update(overrides)
        data = datasets.Dataset.from_dict({"prompt": ["0"] * B})
        trainer = FixedForward(model=tiny_model_path, reward_funcs=score, args=GRPOConfig(**args),
                               train_dataset=data, rollout_func=rollout)
        trainer.current_gradient_accumulation_steps = 1  # set by Trainer's loop, which these calls bypass
        return trainer

    return make


def _batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """Log-probs with ratios inside and outside [0.8, 1.28] (and beyond 3), advantages of both signs, right
    padding and env tokens (mask 0) inside the completion."""
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    log_ratio = torch.randn(B, T, generator=gen, dtype=torch.float64) * 0.5
    log_ratio[0, 1], log_ratio[1, 2] = 1.5, -1.2  # r = 4.5 (beyond the dual clip), r = 0.3
    lengths = torch.tensor([7, 5, 6, 3, 7, 4])
    completion = (torch.arange(T)[None] < lengths[:, None]).long()
    env = torch.ones(B, T, dtype=torch.long)
    env[0, 2:4], env[4, 3] = 0, 0  # environment feedback between two turns
    adv = torch.tensor([1.1, -0.7, -0.4, 0.9, -1.3, 0.4], dtype=torch.float64)
    return {"old": old, "new": old + log_ratio, "completion_mask": completion, "env_mask": env, "adv": adv,
            "entropy": torch.rand(B, T, generator=gen, dtype=torch.float64) * 2}


def _trl_loss(trainer, b: dict[str, torch.Tensor], new: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    trainer.fixed = (new, b["entropy"])
    inputs = {"prompt_ids": torch.zeros(B, 2, dtype=torch.long), "prompt_mask": torch.ones(B, 2, dtype=torch.long),
              "completion_ids": torch.zeros(B, T, dtype=torch.long), "completion_mask": b["completion_mask"],
              "tool_mask": mask, "advantages": b["adv"], "old_per_token_logps": b["old"],
              "num_items_in_batch": (b["completion_mask"] * mask).sum()}
    trainer.model.train()
    return trainer._compute_loss(trainer.model, inputs)


def _our_loss(b: dict[str, torch.Tensor], new: torch.Tensor, mask: torch.Tensor, *, agg: str, dual: float | None,
              entropy_coef: float, num_seqs: int | None = None) -> torch.Tensor:
    loss_mask = b["completion_mask"] * mask
    adv = b["adv"][:, None].expand(B, T)
    loss, _ = policy_loss(PolicyLossInputs(logprobs=new, old_logprobs=b["old"], advantages=adv, mask=loss_mask,
                                           entropy=b["entropy"]),
                          clip_eps_low=0.2, clip_eps_high=0.28, dual_clip_c=dual, loss_agg_mode=agg,
                          entropy_coef=entropy_coef, num_seqs=num_seqs)
    return loss


CASES = [  # (TRL config, our aggregation, our dual clip c, entropy coefficient)
    pytest.param({"loss_type": "bnpo"}, "token-mean", None, 0.0, id="bnpo=token-mean"),
    pytest.param({"loss_type": "dapo"}, "token-mean", None, 0.0, id="dapo=token-mean"),
    pytest.param({"loss_type": "bnpo", "delta": 3.0}, "token-mean", 3.0, 0.0, id="delta=dual-clip"),
    pytest.param({"loss_type": "grpo"}, "seq-mean-token-mean", None, 0.0, id="grpo=seq-mean-token-mean"),
    pytest.param({"loss_type": "bnpo", "delta": 3.0, "entropy_coef": 0.001}, "token-mean", 3.0, 0.001,
                 id="bench-peer-surface"),
]


@pytest.mark.parametrize(("trl_args", "agg", "dual", "entropy_coef"), CASES)
def test_the_loss_agrees_with_trls_token_by_token(make_trainer, trl_args, agg, dual, entropy_coef):
    trainer = make_trainer(**trl_args)
    b = _batch()
    env = b["env_mask"]
    ours_kw = {"agg": agg, "dual": dual, "entropy_coef": entropy_coef}

    # The whole batch: the loss, and its gradient with respect to every token's log-prob.
    new_trl = b["new"].clone().requires_grad_(True)
    new_ours = b["new"].clone().requires_grad_(True)
    trl_loss = _trl_loss(trainer, b, new_trl, env)
    our_loss = _our_loss(b, new_ours, env, **ours_kw)
    assert_close(our_loss, trl_loss.to(our_loss.dtype), rtol=1e-9, atol=1e-12)
    (trl_grad,) = torch.autograd.grad(trl_loss, new_trl)
    (our_grad,) = torch.autograd.grad(our_loss, new_ours)
    assert_close(our_grad, trl_grad, rtol=1e-9, atol=1e-12)
    assert (trl_grad != 0).sum() > B  # the comparison saw live tokens, not only clipped or masked ones

    # Each loss token alone (a one-hot mask): the per-token losses, clipped and dual-clipped ones included. TRL's
    # grpo averages over every row, a row without a loss token too, where we count the rows with one (the same in
    # a batch without such rows, as above): here the caller gives our seq-mean its count of rows, B.
    live = (b["completion_mask"] * env).nonzero().tolist()
    for i, t in live:
        one = torch.zeros_like(env)
        one[i, t] = 1
        assert_close(_our_loss(b, b["new"], one, **ours_kw, num_seqs=B if agg != "token-mean" else None), _trl_loss(trainer, b, b["new"], one).double(),
                     rtol=1e-9, atol=1e-12, msg=lambda m, i=i, t=t: f"token ({i}, {t}): {m}")
    ratio = (b["new"] - b["old"]).exp()
    assert ratio[0, 1] > 3.0 and ratio[1, 2] < 0.8  # both clip branches (and the dual clip) were exercised


def test_a_different_clip_breaks_the_agreement(make_trainer):
    """The comparison can fail: TRL at clip 0.2 / 0.2 differs from ours at 0.2 / 0.28 on the clipped tokens."""
    trainer = make_trainer(epsilon_high=0.2)
    b = _batch()
    ours = _our_loss(b, b["new"], b["env_mask"], agg="token-mean", dual=None, entropy_coef=0.0)
    assert not torch.isclose(ours, _trl_loss(trainer, b, b["new"], b["env_mask"]).double(), rtol=1e-6)


def test_group_normalised_advantages_agree_with_trls(make_trainer):
    """TRL's advantages (its ``_generate_and_score_completions``, scale_rewards "group") and ours (mean_std) on the
    same scores in groups of three: one group with spread, one with none (both give 0 there)."""
    trainer = make_trainer()
    scores = [1.0, -0.1, 0.0, 0.3, 0.3, 0.3]
    trainer.model.train()
    out = trainer._generate_and_score_completions([{"prompt": str(s)} for s in scores])
    ours = group_normalize(torch.tensor(scores, dtype=torch.float64), torch.tensor([0, 0, 0, 1, 1, 1]), "mean_std")
    # TRL divides by std + 1e-4, we by std + 1e-6: relative difference 1e-4 / std (std = 0.61 in the first group).
    assert_close(out["advantages"].double(), ours, rtol=3e-4, atol=1e-7)
    assert ours[:3].abs().min() > 0.3 and (ours[3:] == 0).all()
