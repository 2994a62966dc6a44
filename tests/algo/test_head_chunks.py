"""Chunked log-probs and entropy over a vocabulary head: the same values and gradients as computing
all positions at once, and a peak memory bounded by the chunk, not by the number of positions."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ragen_async.algo import entropy_from_logits, head_logprobs_entropy, logprobs_from_logits


def _setup(n=300, hidden=32, vocab=1000, seed=0):
    g = torch.Generator().manual_seed(seed)
    head = torch.nn.Linear(hidden, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=g) * 0.5)
    h = torch.randn(n, hidden, generator=g).requires_grad_(True)
    targets = torch.randint(vocab, (n,), generator=g)
    return head, h, targets


def _grads(head, h, targets, chunk):
    head.zero_grad(set_to_none=True)
    h.grad = None
    lp, ent = head_logprobs_entropy(head, h, targets, temperature=0.7, chunk_tokens=chunk, with_entropy=True)
    # A loss that weights every position differently, so a misplaced chunk changes the gradient.
    w = torch.linspace(-1.0, 2.0, lp.shape[0])
    ((w * lp).sum() + 0.3 * (w.flip(0) * ent).sum()).backward()
    return lp.detach(), ent.detach(), h.grad.clone(), head.weight.grad.clone()


@pytest.mark.parametrize("chunk", [1, 64, 77, 299, 300, 10_000])
def test_chunked_logprobs_entropy_and_gradients_equal_the_unchunked_ones(chunk):
    """Against the plain formula on the full [N, V] logits (values and gradients up to about 30). The
    chunks run the same fp32 operations on row blocks, so only rounding may differ: a one-row chunk
    goes through a matrix-vector kernel instead of a matrix product, and the weight gradient sums the
    chunks in another order (measured: at most 1.2e-5 absolute, at chunk 1 on the weight gradient).
    Tolerance: 2e-5 absolute + 1e-5 relative; a misplaced chunk or a lost term errs by O(1)."""
    head, h, targets = _setup()
    logits = head(h).float() / 0.7
    ref_lp = logprobs_from_logits(logits[None], targets[None])[0]
    ref_ent = entropy_from_logits(logits[None])[0]
    full = _grads(head, h, targets, None)
    torch.testing.assert_close(full[0], ref_lp.detach(), rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(full[1], ref_ent.detach(), rtol=1e-6, atol=1e-6)
    got = _grads(head, h, targets, chunk)
    for name, a, b in zip(("logprobs", "entropy", "hidden grad", "weight grad"), got, full, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=2e-5, msg=name)


def test_no_grad_chunks_and_no_positions():
    head, h, targets = _setup(n=50)
    with torch.no_grad():
        lp, ent = head_logprobs_entropy(head, h, targets, chunk_tokens=8, with_entropy=False)
        full, _ = head_logprobs_entropy(head, h, targets, with_entropy=False)
    assert ent is None and not lp.requires_grad
    torch.testing.assert_close(lp, full, rtol=1e-6, atol=1e-6)
    lp, ent = head_logprobs_entropy(head, h[:0], targets[:0], chunk_tokens=8)
    assert lp.shape == ent.shape == (0,)
    (lp.sum() + ent.sum()).backward()  # an empty micro-batch still reaches the head's weights
    assert head.weight.grad is not None and not head.weight.grad.any()


_PEAK_SCRIPT = textwrap.dedent("""
    import sys, torch
    from ragen_async.algo import head_logprobs_entropy

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024

    torch.manual_seed(0)
    torch.set_num_threads(2)  # (threads share the chunk's tensors: the peak does not grow with them)
    vocab, hidden, n, chunk = 151_936, 64, 2048, int(sys.argv[1])
    head = torch.nn.Linear(hidden, vocab, bias=False)
    h = torch.randn(n, hidden, requires_grad=True)
    targets = torch.randint(vocab, (n,))
    try:
        open("/proc/self/clear_refs", "w").write("5")  # reset the peak (VmHWM) to the current RSS
    except OSError:
        pass  # the setup above allocates nothing larger than what stays live, so the peak is the RSS
    base = status("VmRSS")
    lp, ent = head_logprobs_entropy(head, h, targets, chunk_tokens=chunk, with_entropy=True)
    (lp.sum() + 0.01 * ent.sum()).backward()
    assert h.grad is not None and head.weight.grad is not None
    print(status("VmHWM") - base)
""")


@pytest.mark.slow
@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the peak RSS from /proc (Linux)")
def test_peak_memory_of_a_paper_vocabulary_head_is_bounded_by_the_chunk():
    """Forward and backward of log-probs and entropy over 2,048 positions of a 151,936-token head
    (Qwen2.5's vocabulary), in a fresh process, peak RSS above the baseline after setup.

    Unchunked, the fp32 logits alone are 2048 x 151936 x 4 B = 1,187 MiB, and the softmax, logsumexp
    and their gradients hold several such tensors at once (about 2 GiB measured for just 512 positions,
    so about 8 GiB for 2,048). The bound is one full fp32 logits tensor: the test fails if the logits of
    all positions ever exist at once. With 128-position chunks a logits tensor is 74 MiB; about ten
    of them are live in a chunk's backward (recomputed logits, softmax, their gradients) plus the
    39 MiB head weight gradient: about 0.7 GiB measured, independent of the number of positions."""
    chunk = 128
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    out = subprocess.run([sys.executable, "-c", _PEAK_SCRIPT, str(chunk)], capture_output=True, text=True,
                         env=env, timeout=600)
    assert out.returncode == 0, out.stderr
    peak = int(out.stdout.strip().splitlines()[-1])
    full_logits = 2048 * 151_936 * 4
    print(f"peak {peak / 2**20:.0f} MiB; one unchunked fp32 logits tensor {full_logits / 2**20:.0f} MiB")
    assert peak < full_logits
