"""Helpers shared by the engine tests: a tiny random Llama, a no-cache greedy reference, the divergence rule."""
from __future__ import annotations

from collections.abc import Iterator, Sequence

import pytest
import torch

from minillm.config import LlamaConfig
from minillm.course.exercises.ch10.tiny import TINY_CONFIG, init_large_gaps
from minillm.model.llama import LlamaForCausalLM

# Two greedy runs may pick different tokens only where the two best logits are closer than this: fp32 rounding of
# a different (but equally correct) summation order moves logits by ~1e-5 at most on SmolLM2.
TIE_GAP = 1e-4

@pytest.fixture(scope="module")
def single_thread() -> Iterator[None]:
    """Run a module's tests with one torch thread, then restore the count.

    Engine steps are many small ops (decodes of a few rows, a tiny model). With two threads on two cores that are
    also busy (a second xdist worker, other processes), every op waits at an OpenMP barrier for a descheduled
    thread, which we measured to make these tests 3-5x slower in CPU time. One thread per process avoids it.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def run_step(runner, scheduler_output):  # noqa: ANN001, ANN201 - a ModelRunner or a Worker; a ModelRunnerOutput
    """One whole step on a model runner: ``execute_model`` then, when it has tokens to sample, ``sample_tokens``
    (what the engine core does with ``grammar_output=None``)."""
    output = runner.execute_model(scheduler_output)
    return runner.sample_tokens(None) if output is None else output


TINY: LlamaConfig = TINY_CONFIG  # chapter 10's tiny model is the same one


def tiny_model(seed: int = 0) -> LlamaForCausalLM:
    """A random 2-layer Llama whose logits have large gaps (embedding std 1, tied head), so greedy tokens do not
    depend on fp32 rounding."""
    torch.manual_seed(seed)
    return init_large_gaps(LlamaForCausalLM(TINY).eval())


@torch.inference_mode()
def greedy_reference(model: LlamaForCausalLM, prompt: Sequence[int], max_tokens: int
                     ) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens by recomputing the whole sequence without any cache at every step, and each step's logits."""
    ids = list(prompt)
    tokens, logits = [], []
    for _ in range(max_tokens):
        hidden = model(torch.tensor(ids))
        row = model.compute_logits(hidden[-1:])[0]
        tokens.append(int(row.argmax()))
        logits.append(row)
        ids.append(tokens[-1])
    return tokens, logits


def top2_gap(logits: torch.Tensor) -> float:
    top = logits.float().topk(2).values
    return float(top[0] - top[1])


def check_greedy_match(ours: Sequence[int], ref: Sequence[int], ref_logits: Sequence[torch.Tensor],
                       what: str = "") -> int | None:
    """Assert ``ours == ref`` up to the first divergence, and that a divergence happens only at a near tie.

    At the first differing position the reference's two best logits must be within :data:`TIE_GAP` and our token
    must be one of those two; after it the sequences legitimately go apart, so nothing more is compared.

    Returns:
        The position of the accepted divergence, or ``None`` when the tokens are identical.
    """
    assert len(ours) == len(ref), f"{what}: {len(ours)} tokens, reference has {len(ref)}"
    for i, (a, b) in enumerate(zip(ours, ref)):
        if a != b:
            gap = top2_gap(ref_logits[i])
            top2 = ref_logits[i].float().topk(2).indices.tolist()
            assert gap < TIE_GAP and a in top2, (
                f"{what}: token {i} is {a}, the reference says {b} with a top-2 logit gap of {gap:.2e} "
                f"(only a gap < {TIE_GAP} may flip); ours {list(ours)}, reference {list(ref)}")
            return i
    return None
