"""The three decoders, batch size 1, greedy: target only, naive speculative decoding, BiLD.

Each takes a prompt (text or token ids) and returns a ``Generation`` (new token ids, text,
``DecodeStats``). EOS and ``max_new_tokens`` end a generation in every decoder alike; the EOS
token, when produced, is part of the output (as with ``generate``).
"""

from __future__ import annotations

import torch

from bild_env.decoding.bild import (FIXED_FALLBACK, FIXED_ROLLBACK, LOOKUP_SCORES, MAX_DRAFT_LEN, BildSession,
                                    DraftScore, check_score, check_thresholds)
from bild_env.decoding.cost_model import CostModel
from bild_env.decoding.loop import Committed
from bild_env.models.lookup import lookup_for
from bild_env.models.pairs import ModelPair
from bild_env.decoding.runner import LiveRunner
from bild_env.decoding.stats import DecodeStats, Generation


def _positive_int(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be an integer >= 1, got {value!r}")


def prepare_prompt(pair: ModelPair, prompt: str | list[int] | torch.Tensor, max_new_tokens: int) -> list[int]:
    """Token ids of ``prompt``, checked to leave room for ``max_new_tokens`` under the models' positions."""
    _positive_int("max_new_tokens", max_new_tokens)
    ids = pair.encode(prompt)
    if len(ids) + max_new_tokens > pair.max_positions:
        raise ValueError(
            f"the prompt has {len(ids)} tokens and max_new_tokens is {max_new_tokens}, but the models take at most "
            f"{pair.max_positions} positions: shorten the prompt to at most {pair.max_positions - max_new_tokens} "
            "tokens or lower max_new_tokens"
        )
    return ids


def start_live(pair: ModelPair, prompt, max_new_tokens: int, cost_model: CostModel | None) -> Committed:
    """A live generation of ``prompt`` after the target's prefill (a decoder's loop, here or in ``scripts.analysis.stop_rules``,
    runs on it and ends with ``live_result``)."""
    ids = prepare_prompt(pair, prompt, max_new_tokens)
    return Committed(LiveRunner(pair, cost_model), ids, max_new_tokens, pair.eos_token_ids, pair.device)


def live_result(pair: ModelPair, run: Committed, counts: DecodeStats) -> Generation:
    """The ``Generation`` of a finished run: the runner's forward statistics plus the decoder's ``counts``."""
    wall = run.elapsed_ms(run.t0)
    stats = run.runner.stats
    for name in ("proposed", "accepted", "full_accepts", "steps", "fallbacks"):
        setattr(stats, name, getattr(counts, name))
    stats.new_tokens = len(run.new_ids)
    stats.wall_ms = wall
    return Generation(run.tokens[: run.prompt_len], run.new_ids, pair.decode(run.new_ids), stats)


def generate_target_only(
    pair: ModelPair, prompt: str | list[int] | torch.Tensor, max_new_tokens: int = 64, cost_model: CostModel | None = None
) -> Generation:
    """Greedy decoding with the target alone and its KV cache (the "single model" baseline)."""
    run = start_live(pair, prompt, max_new_tokens, cost_model)
    while not run.done:
        argmax = run.runner.target_verify(run.tokens)[0]
        run.tokens.append(argmax[-1])
    return live_result(pair, run, DecodeStats())


@torch.inference_mode()
def generate_hf_assisted(pair: ModelPair, prompt: list[int], max_new_tokens: int) -> Generation:
    """Hugging Face assisted generation, ``target.generate(assistant_model=draft)``, greedy, with transformers'
    defaults; timed on the wall clock (``stats.wall_ms``, synchronised on the device) and the target's forwards counted
    by a hook (``stats.target_forwards``)."""
    import time

    from bild_env.models.device import sync

    ids = torch.tensor([prompt], device=pair.device)
    calls = [0]
    hook = pair.target.register_forward_hook(lambda *_: calls.__setitem__(0, calls[0] + 1))
    sync(pair.device)
    t0 = time.perf_counter()
    try:
        out = pair.target.generate(ids, attention_mask=torch.ones_like(ids), assistant_model=pair.draft,
                                   do_sample=False, max_new_tokens=max_new_tokens,
                                   pad_token_id=pair.tokenizer.pad_token_id or pair.tokenizer.eos_token_id)
        sync(pair.device)
    finally:
        hook.remove()
    wall = (time.perf_counter() - t0) * 1000.0
    new = out[0, ids.shape[1]:].tolist()
    return Generation(list(prompt), new, pair.tokenizer.decode(new),
                      DecodeStats(new_tokens=len(new), target_forwards=calls[0], wall_ms=wall, forward_ms=wall))


def verify_drafts(run: Committed, drafted: int, counts: DecodeStats) -> None:
    """Naive SD's verification of the last ``drafted`` tokens of ``run``: one target forward over the tokens its cache
    lacks, the longest prefix equal to the target's argmax kept, the rejected suffix cropped from the output and both
    caches, the target's own next token appended; the step counted in ``counts``."""
    runner, tokens = run.runner, run.tokens
    n = len(tokens)
    argmax = runner.target_verify(tokens)[0]
    off = len(argmax) - drafted - 1  # argmax[off + j] is the target's choice for draft token j
    accepted = 0
    while accepted < drafted and tokens[n - drafted + accepted] == argmax[off + accepted]:
        accepted += 1
    keep = n - drafted + accepted
    del tokens[keep:]
    runner.crop(keep)
    if not run.done:
        tokens.append(argmax[off + accepted])
    counts.steps += 1
    counts.proposed += drafted
    counts.accepted += accepted
    counts.full_accepts += 0 < accepted == drafted


def generate_speculative(
    pair: ModelPair,
    prompt: str | list[int] | torch.Tensor,
    k: int = 4,
    max_new_tokens: int = 64,
    cost_model: CostModel | None = None,
    confidence: float = 0.0,
    score: str = "token",
    predictor=None,
) -> Generation:
    """Naive speculative decoding: the draft proposes k tokens, one target forward verifies them.

    The longest prefix equal to the target's argmax is kept, plus the target's own next token, so
    the output is exactly the target's greedy output.

    ``confidence`` > 0 makes the draft length adaptive (transformers' ``assistant_confidence_threshold``):
    the draft stops proposing after a token whose max probability is below it (that token is still
    verified: its forward is paid for, and a target forward fed one more token costs little), so ``k`` is
    the most it proposes. The output is the target's greedy output all the same; 0 is plain naive SD.
    ``score="cumulative"`` compares the threshold with the product of the run's max probabilities instead
    (SpecDec++'s stopping rule: stop once the predicted chance that some token of the run is rejected passes
    1 - ``confidence``; ``bild.DraftScore``). ``score="lookup"`` / ``"lookup_cumulative"`` read the pair's lookup
    predictor instead of the max probability (``bild_env.models.lookup``; ``predictor`` overrides the one
    ``lookup_for(pair)`` finds). Lossless all the same.
    """
    _positive_int("k", k)
    if isinstance(confidence, bool) or not isinstance(confidence, (int, float)) or not 0.0 <= confidence <= 1.0:
        raise ValueError(f"confidence must be a probability in [0, 1] (0: always propose k tokens), got {confidence!r}")
    if check_score(score) == "oracle":
        raise ValueError("the oracle score needs the replay trees (the envs); live decoding takes score='token', "
                         "'cumulative', 'lookup' or 'lookup_cumulative'")
    if predictor is None and score in LOOKUP_SCORES:
        predictor = lookup_for(pair)
    run = start_live(pair, prompt, max_new_tokens, cost_model)
    runner, tokens, counts, stop = run.runner, run.tokens, DecodeStats(), DraftScore(score, predictor)
    while not run.done:
        # 1. propose: up to k draft tokens, leaving room for the target's token; stop after an unsure one
        budget, drafted = min(k, run.remaining - 1), 0
        stop.start()
        while drafted < budget and tokens[-1] not in run.eos:
            token, p_max = runner.draft_next(tokens)
            value = stop.next(p_max, None, tokens, token)  # the context before the proposal
            tokens.append(token)
            drafted += 1
            if value < confidence:
                counts.fallbacks += 1
                break
        verify_drafts(run, drafted, counts)
    return live_result(pair, run, counts)


STOP_SCORES = ("token", "cumulative", *LOOKUP_SCORES)  # what a stopping rule can read (K:F:score)


def parse_stop_rule(text: str) -> tuple[int, float, str]:
    """``"K:F"`` -> ``(K, F, "token")``: naive SD's adaptive length (at most K draft tokens, stopping after one whose
    max probability is below F); ``"K:F:cumulative"`` -> ``(K, F, "cumulative")`` (stopping once the run's product
    of max probabilities is below F); ``"K:F:lookup"`` and ``"K:F:lookup_cumulative"`` the same with the pair's lookup
    predictor (``bild_env.models.lookup``). ValueError saying the form for anything else."""
    parts = text.split(":")
    try:
        if len(parts) not in (2, 3):
            raise ValueError
        k, f = int(parts[0]), float(parts[1])
    except ValueError:
        raise ValueError(f"{text!r}: give K:F or K:F:cumulative, the most draft tokens and the confidence that stops "
                         "the draft (of the last token, or of the run's product), e.g. 8:0.5 or 8:0.2:cumulative") from None
    if k < 1 or not 0.0 <= f <= 1.0:
        raise ValueError(f"{text!r}: K must be at least 1 and F a probability in [0, 1]")
    score = parts[2] if len(parts) == 3 else "token"
    if score not in STOP_SCORES:
        raise ValueError(f"{text!r}: the third part names the score, {', '.join(STOP_SCORES)}, got {score!r}")
    return k, f, score


def parse_adaptive(text: str) -> tuple[int, float]:
    """``"K:F"`` -> ``(K, F)`` (``parse_stop_rule`` with the token score only)."""
    k, f, score = parse_stop_rule(text)
    if score != "token":
        raise ValueError(f"{text!r}: give K:F here (the token score)")
    return k, f


def stop_rule_name(k: int, f: float, score: str = "token") -> str:
    """The row name of naive SD's adaptive length: ``naive SD (k<=8, stop<0.5)``, ``naive SD (k<=8, cum<0.2)``."""
    name = {"token": "stop", "cumulative": "cum", "lookup": "lookup", "lookup_cumulative": "lookup cum"}[score]
    return f"naive SD (k<={k}, {name}<{f})"


def generate_bild(
    pair: ModelPair,
    prompt: str | list[int] | torch.Tensor,
    fallback: float = FIXED_FALLBACK,
    rollback: float = FIXED_ROLLBACK,
    max_draft_len: int = MAX_DRAFT_LEN,
    max_new_tokens: int = 64,
    cost_model: CostModel | None = None,
) -> Generation:
    """BiLD with fixed thresholds: ``BildSession`` stepped to the end (see bild_env.decoding.bild)."""
    check_thresholds(fallback, rollback)
    _positive_int("max_draft_len", max_draft_len)
    session = new_bild_session(pair, prompt, max_new_tokens, max_draft_len, cost_model)
    while not session.done:
        session.step(fallback, rollback)
    new = session.new_ids
    return Generation(session.tokens[: session.prompt_len], new, pair.decode(new), session.total)


def new_bild_session(
    pair: ModelPair,
    prompt: str | list[int] | torch.Tensor,
    max_new_tokens: int = 64,
    max_draft_len: int = MAX_DRAFT_LEN,
    cost_model: CostModel | None = None,
) -> BildSession:
    """A step-wise BiLD session on live models (the target prefill has run)."""
    _positive_int("max_draft_len", max_draft_len)
    ids = prepare_prompt(pair, prompt, max_new_tokens)
    return BildSession(LiveRunner(pair, cost_model), ids, max_new_tokens, pair.eos_token_ids, max_draft_len, pair.device)


def decode_with(pair: ModelPair, prompt, method: dict, cost_model: CostModel | None = None,
                max_new_tokens: int = 64) -> Generation:
    """Decode ``prompt`` with the method ``method`` names: ``{}`` target only, ``{"k": k}`` naive speculative
    decoding (``{"k": k, "confidence": f}``: its adaptive length, ``"score": "cumulative"`` its cumulative rule), ``{"fallback": f, "rollback": r}`` BiLD
    (what benchmarks and calibrations loop over)."""
    if "k" in method:
        return generate_speculative(pair, prompt, method["k"], max_new_tokens, cost_model,
                                    method.get("confidence", 0.0), method.get("score", "token"))
    if method:
        return generate_bild(pair, prompt, method["fallback"], method["rollback"], max_new_tokens=max_new_tokens,
                             cost_model=cost_model)
    return generate_target_only(pair, prompt, max_new_tokens, cost_model)
