"""The lookup acceptance predictor (bild_env.models.lookup), the scores that read it, and ``python -m distill lookup``.

The context's n-gram lookups by hand and against a brute-force search; the predictor's probability by hand, saved
and loaded, refused with what to do when missing or fitted on another draft; the lookup scores stop runs as
hand-computed on a scripted runner and keep the lossless decoders exact in float32; the command end to end on
tiny-random.
"""

from __future__ import annotations

import json
import math
import random
from types import SimpleNamespace

import numpy as np
import pytest

from bild_env import generate_speculative, generate_target_only
from bild_env.decoding.bild import BildSession, DraftScore
from bild_env.decoding.decoders import new_bild_session, parse_stop_rule, stop_rule_name
from bild_env.models.lookup import (
    FEATURES, LOOKUP_FILE, NGRAMS, LookupMismatchError, LookupPredictor, context_features, load_lookup, lookup_for,
    lookup_path, save_lookup,
)
from tests.test_batched_decoding import random_prompt
from tests.test_scores import scripted
from tests.test_serving import make_serve, workload  # noqa: F401 (the fixtures)

K = len(NGRAMS)


def named(features: np.ndarray) -> dict[str, float]:
    return {name: float(v) for name, v in zip(FEATURES[1:], features) if v}


def test_lookups_by_hand():
    # ... 5 6 7 5 6 -> the last 6 and the last "5 6" were followed by 7; "7 5 6" never occurred before
    assert named(context_features([5, 6, 7, 5, 6], 7)) == {"agrees_1": 1, "agrees_2": 1, "in_context": 1}
    assert named(context_features([5, 6, 7, 5, 6], 9)) == {"differs_1": 1, "differs_2": 1}
    # the latest earlier occurrence counts: "3" was followed by 4, then by 8
    assert named(context_features([3, 4, 3, 8, 3], 8)) == {"agrees_1": 1, "in_context": 1}
    assert named(context_features([1, 1, 1, 1, 1, 1, 1, 1], 1)) == {
        **{f"agrees_{n}": 1 for n in NGRAMS}, "in_context": 1, "repeats_last": 1}
    assert named(context_features([], 3)) == {} and named(context_features([3], 3)) == {"in_context": 1, "repeats_last": 1}


def brute_force(context: list[int], proposal: int) -> np.ndarray:
    out = np.zeros(2 * K + 2, dtype=np.float32)
    for i, n in enumerate(NGRAMS):
        for s in range(len(context) - n - 1, -1, -1):
            if context[s:s + n] == context[len(context) - n:]:
                out[i if context[s + n] == proposal else K + i] = 1
                break
    if context:
        out[2 * K], out[2 * K + 1] = proposal in context, context[-1] == proposal
    return out


def test_lookups_equal_a_brute_force_search():
    rng = random.Random(0)
    for alphabet in ([0, 1, 2, 3], [0, 1, 255, 256, 65535, 65536, 16777216, 49151]):  # ids across byte boundaries
        for _ in range(3000):
            context = [rng.choice(alphabet) for _ in range(rng.randint(0, 25))]
            proposal = rng.choice(alphabet)
            expected = brute_force(context, proposal)
            assert np.array_equal(context_features(context, proposal), expected), (context, proposal)
            assert np.array_equal(context_features(np.array(context, dtype=np.int64), proposal), expected)


def test_the_predictor_by_hand_saved_and_loaded(tmp_path):
    weights = [2.0] + [0.0] * (len(FEATURES) - 1)
    weights[FEATURES.index("agrees_2")] = 1.5
    predictor = LookupPredictor(tuple(weights), -1.0, draft="draft-a")
    assert predictor.probability(0.5, [5, 6, 7, 5, 6], 7) == pytest.approx(1 / (1 + math.exp(-(-1 + 1 + 1.5))))
    assert predictor.probability(0.5, [5, 6, 7, 5, 6], 9) == pytest.approx(0.5)
    rows = np.stack([np.r_[0.5, context_features([5, 6, 7, 5, 6], t)] for t in (7, 9)])
    assert predictor.probabilities(rows) == pytest.approx([predictor.probability(0.5, [5, 6, 7, 5, 6], t) for t in (7, 9)])
    path = save_lookup(predictor, tmp_path)
    assert path == tmp_path / LOOKUP_FILE
    assert load_lookup(tmp_path, "draft-a") == predictor
    with pytest.raises(LookupMismatchError, match="fitted on draft 'draft-a'.*distill lookup"):
        load_lookup(path, "draft-b")
    with pytest.raises(LookupMismatchError, match="no acceptance lookup predictor.*python -m distill lookup"):
        load_lookup(tmp_path / "nowhere")
    (tmp_path / "junk.json").write_text("{}")
    with pytest.raises(LookupMismatchError, match="is not an acceptance lookup predictor"):
        load_lookup(tmp_path / "junk.json")
    with pytest.raises(LookupMismatchError, match="finite weights"):
        LookupPredictor((1.0,), 0.0)


def test_lookup_for_reads_beside_the_draft_then_the_cache(tmp_path):
    from bild_env.models.lookup import draft_key

    pair = SimpleNamespace(ids=(str(tmp_path), ""), fingerprints=("fp", ""), draft_vocab="")
    with pytest.raises(LookupMismatchError, match="python -m distill lookup"):
        lookup_for(pair)
    cached = LookupPredictor((0.0,) * len(FEATURES), 1.0, draft=draft_key("fp"))
    save_lookup(cached, lookup_path(pair, adopted=False))
    assert lookup_for(pair) == cached
    beside = LookupPredictor((0.0,) * len(FEATURES), 2.0, draft=draft_key("fp"))
    save_lookup(beside, lookup_path(pair, adopted=True))
    assert lookup_path(pair, adopted=True) == tmp_path / LOOKUP_FILE and lookup_for(pair) == beside


def constant(p: float) -> LookupPredictor:
    """A predictor that says ``p`` whatever it reads."""
    return LookupPredictor((0.0,) * len(FEATURES), math.log(p / (1 - p)))


def test_lookup_scores_by_hand():
    token, cumulative = DraftScore("lookup", constant(0.6)), DraftScore("lookup_cumulative", constant(0.6))
    for s in (token, cumulative):
        s.start()
    assert [token.next(0.1, None, [1, 2], 3) for _ in range(3)] == pytest.approx([0.6] * 3)
    assert [cumulative.next(0.1, None, [1, 2], 3) for _ in range(3)] == pytest.approx([0.6, 0.36, 0.216])
    with pytest.raises(ValueError, match="lookup predictor.*distill lookup"):
        DraftScore("lookup")
    assert parse_stop_rule("8:0.3:lookup_cumulative") == (8, 0.3, "lookup_cumulative")
    assert stop_rule_name(8, 0.3, "lookup_cumulative") == "naive SD (k<=8, lookup cum<0.3)"


@pytest.mark.parametrize("score, proposed, fallbacks", [("lookup", 4, 0), ("lookup_cumulative", 1, 1)])
def test_a_session_stops_on_the_lookup_score(score, proposed, fallbacks):
    # every proposal predicted kept with 0.6: the token form never falls below 0.55, the product does at the second
    session = BildSession(scripted([0.9, 0.9, 0.9, 0.9]), [0], max_new_tokens=10, max_draft_len=4, score=score,
                          predictor=constant(0.6))
    s = session.step(0.55, math.inf)
    assert (s.proposed, s.fallbacks, s.accepted) == (proposed, fallbacks, proposed)


def lookup_minded() -> LookupPredictor:
    """A predictor that trusts repeats and the max probability (weights of the sign a fit gives)."""
    weights = dict.fromkeys(FEATURES, 0.0) | {"max_prob": 3.0, "agrees_2": 2.0, "differs_2": -1.5, "agrees_4": 1.0}
    return LookupPredictor(tuple(weights[f] for f in FEATURES), -1.5)


@pytest.mark.parametrize("k, confidence, score", [(4, 0.5, "lookup"), (8, 0.3, "lookup_cumulative")])
def test_lookup_naive_sd_is_lossless(agreeing_pair, k, confidence, score):
    stopped = 0
    for seed in range(3):
        prompt = random_prompt(seed, 5 + 3 * seed)
        reference = generate_target_only(agreeing_pair, prompt, 24).new_ids
        g = generate_speculative(agreeing_pair, prompt, k, 24, confidence=confidence, score=score,
                                 predictor=lookup_minded())
        assert g.new_ids == reference
        stopped += g.stats.fallbacks
    assert stopped > 0  # the score did stop runs


def test_lossless_bild_with_the_lookup_score_is_exact(agreeing_pair):
    for seed in range(3):
        prompt = random_prompt(20 + seed, 6)
        session = new_bild_session(agreeing_pair, prompt, 20, max_draft_len=6)
        session.score = DraftScore("lookup_cumulative", lookup_minded())
        while not session.done:
            session.step(0.4, 0.0)  # rollback 0: every token the target would not pick is undone
        assert session.new_ids == generate_target_only(agreeing_pair, prompt, 20).new_ids


def test_the_distill_lookup_command_runs_end_to_end(tmp_path, capsys):
    from distill.cli import main

    out, where = tmp_path / "lookup.json", tmp_path / "lookup"
    main(["lookup", "--pair", "tiny-random", "--train-prompts", "3", "--eval-prompts", "2", "--max-new-tokens", "10",
          "--early", "4", "--timing-repeats", "5", "--lookup-out", str(where), "--out", str(out)])
    result = json.loads(out.read_text())
    assert "adopted" in capsys.readouterr().out
    for split in ("validation", "test"):
        for domain in ("prose", "code", "chat", "long"):  # long inputs: reported, never fitted on
            row = result[split][domain]
            assert row["positions"] > 0 and row["prompts"] == 2 and 0 < row["early"]["positions"] <= row["positions"]
            for scorer in ("lookup", "max_prob"):
                assert set(row[scorer]) == {"auc", "ece", "brier"}
    assert set(result["validation_auc_margin"]) == {"prose", "code", "chat"} and set(result["train_positions"]) == {
        "prose", "code", "chat"}
    assert result["adopted"] == all(m > 0 for m in result["validation_auc_margin"].values())
    saved = load_lookup(result["lookup_file"])
    assert result["lookup_file"] == str(where / LOOKUP_FILE)
    assert dict(zip(FEATURES, saved.weights)) == pytest.approx(result["weights"])
    assert result["cost"]["lookup_ms_224"] > 0 and result["cost"]["draft_forward_ms"] > 0
    with pytest.raises(SystemExit, match="error: --early"):
        main(["lookup", "--pair", "tiny-random", "--early", "0"])
    with pytest.raises(SystemExit, match="must not be among --domains"):
        main(["lookup", "--pair", "tiny-random", "--unseen-domains", "code"])


def test_the_ablation_script_fits_every_group_and_rates_tokens_by_hand(tmp_path, capsys):
    from tests.test_serving_bench import _script

    script = _script("lookup_ablation")
    keys, y = np.array([0, 0, 1, 2, 2, 2]), np.array([1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    assert script.rates(keys, y, 0.5, 4) == pytest.approx([(1 + 10) / 22, (1 + 10) / 21, (1 + 10) / 23, 0.5])
    out = tmp_path / "ablation.json"
    report = script.main(["--pair", "tiny-random", "--train-prompts", "3", "--eval-prompts", "2", "--max-new-tokens", "10",
                          "--early", "4", "--out", str(out)])
    assert set(report["sets"]) == {"lookup predictor", "+ logit", "+ draft", "+ running", "+ target", "+ tokens",
                                   "+ target_state", "+ all"}
    for entry in [report["max_prob"], *report["sets"].values()]:
        assert set(entry) == {f"{s}/{d}" for s in ("validation", "test") for d in ("prose", "code", "chat")}
    assert json.loads(out.read_text())["train_positions"] == report["train_positions"] > 0
    assert "+ all" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        script.main(["--pair", "tiny-random", "--early", "0"])


def test_the_ablation_reads_the_targets_state_where_its_verification_left_it():
    import torch

    from bild_env.models.pairs import load_pair
    from distill.lookup import LookupConfig, context_rows
    from tests.test_serving_bench import _script

    cfg = LookupConfig(pair="tiny-random", train_prompts=3, eval_prompts=2, max_new_tokens=10)
    pair = load_pair("tiny-random")
    rows = context_rows(pair, cfg, "code", "validation")
    states, embeddings = _script("lookup_ablation").target_states(pair, rows)
    assert states.shape == (len(rows["label"]), pair.target.config.hidden_size) == embeddings.shape
    text = rows["texts"][0].tolist()
    prompt_length = len(text) - int((rows["prompt"] == 0).sum()) - 1  # the rows read all but the first new token
    for k, row in enumerate(np.flatnonzero(rows["prompt"] == 0)):  # continuation row k + 1; its block starts at k + 1 - depth
        start = k + 1 - int(rows["extra"]["depth"][row])
        with torch.inference_mode():  # the last position of a forward over what was verified before the block
            alone = pair.target(torch.tensor([text[:prompt_length + start - 1]]), output_hidden_states=True).hidden_states[-1]
        assert np.allclose(states[row], alone[0, -1].float().numpy(), atol=1e-4)
        assert np.array_equal(embeddings[row], pair.target.get_input_embeddings().weight[int(rows["proposal"][row])].detach().float().numpy())
        assert int(rows["last"][row]) == text[prompt_length + k]  # the token before the row's proposal


@pytest.fixture
def tiny_lookup(tiny_pair):
    """tiny-random's lookup predictor where ``lookup_for`` finds it (the test cache), removed afterwards."""
    from bild_env.models.lookup import draft_key

    path = lookup_path(tiny_pair, adopted=False)
    weights = dict(zip(FEATURES, lookup_minded().weights))
    save_lookup(LookupPredictor(tuple(weights.values()), -1.5, draft_key(tiny_pair.fingerprints[0], tiny_pair.draft_vocab)),
                path)
    yield path
    path.unlink()


def test_the_envs_refuse_a_lookup_score_without_a_predictor(make_env, make_serve, tiny_pair, workload):  # noqa: F811
    assert not lookup_path(tiny_pair, adopted=False).is_file() and not lookup_path(tiny_pair, adopted=True).is_file()
    with pytest.raises(LookupMismatchError, match="python -m distill lookup"):
        make_env(actions={"score": "lookup"})
    with pytest.raises(LookupMismatchError, match="python -m distill lookup"):
        make_serve(actions={"score": "lookup_cumulative"})


def test_envs_with_the_lookup_score_pass_the_checker_and_serve_exactly(make_env, make_serve, tiny_pair, workload,  # noqa: F811
                                                                       tiny_lookup):
    from gymnasium.utils.env_checker import check_env

    check_env(make_env(actions={"score": "lookup_cumulative"}).unwrapped, skip_render_check=True)
    env = make_env(actions={"score": "lookup_cumulative"})
    env.reset(seed=0)
    proposed = 0
    for _ in range(4):
        _, _, terminated, truncated, info = env.step(12)
        proposed += info["proposed"]
        if terminated or truncated:
            break
    assert proposed > 0
    serve = make_serve(actions={"score": "lookup_cumulative", "rollback_values": (0.5,)}, max_new_tokens=10,
                       episode_steps=30, load="constant:0.8")
    check_env(serve.unwrapped, skip_render_check=True)
    serve.reset(seed=1)
    finished = []
    for _ in range(30):
        _, _, _, truncated, info = serve.step(2)  # the middle fallback value
        finished += info["finished"]
    assert finished
    for f in finished:  # rollback 0.5 nats keeps this pair's requests exact, whatever the score stopped
        prompt = workload.prompts[f["domain"]][f["prompt_index"]]
        assert f["new_ids"] == generate_target_only(tiny_pair, prompt, 10).new_ids


def test_batched_lookup_equals_each_sessions(agreeing_pair):
    from bild_env.decoding.batched import BatchedDecoder
    from tests.test_batched_decoding import COUNTS, counts

    prompts = [random_prompt(30 + r, n) for r, n in enumerate((3, 9, 17))]
    decoder = BatchedDecoder(agreeing_pair, max_draft_len=6, score="lookup_cumulative", predictor=lookup_minded())
    decoder.join(prompts, 20, [0, 1, 2])
    steps = {r: [] for r in range(3)}
    while len(decoder):
        for rid, s in decoder.step(0.4, 0.5).items():
            steps[rid].append(s)
    fallbacks = 0
    for rid, prompt in enumerate(prompts):
        session = new_bild_session(agreeing_pair, prompt, 20, max_draft_len=6)
        session.score = DraftScore("lookup_cumulative", lookup_minded())
        alone = []
        while not session.done:
            alone.append(session.step(0.4, 0.5))
        assert decoder.finished[rid].new_ids == session.new_ids == generate_target_only(agreeing_pair, prompt, 20).new_ids
        assert [counts(s, COUNTS) for s in steps[rid]] == [counts(s, COUNTS) for s in alone]
        fallbacks += sum(s.fallbacks for s in alone)
    assert fallbacks > 0


def test_foresee_reads_the_lookup_predictor(make_env, tiny_pair, tiny_lookup):
    from bild_env.models.lookup import lookup_for

    token_env, lookup_env = make_env(observation="foresee", backend="replay", latency="model"), make_env(
        observation="foresee", backend="replay", latency="model", actions={"score": "lookup"})
    obs_t, _ = token_env.reset(seed=3)
    obs_l, _ = lookup_env.reset(seed=3)
    env = lookup_env.unwrapped
    token, p = env.runner.peek_proposal(env.session.tokens)
    assert obs_t[17] == pytest.approx(p)  # the max probability of the same next proposal
    assert obs_l[17] == pytest.approx(lookup_for(tiny_pair).probability(p, env.session.tokens, token), abs=1e-6)


def test_observe_next_reads_the_lookup_predictor(make_serve, tiny_pair, tiny_lookup):  # noqa: F811 (the fixture)
    from bild_env.models.lookup import lookup_for

    env = make_serve(observe={"next": True}, actions={"score": "lookup"}, load="constant:0.8").unwrapped
    env.reset(seed=2)
    obs, *_ = env.step(2)
    running = [r for r in env.active if not r.session.done]
    assert running and len(env.view.next_p) == len(running)
    predictor = lookup_for(tiny_pair)
    for r, score in zip(running, env.view.next_p):
        token, p = r.runner.peek_proposal(r.session.tokens)
        assert score == pytest.approx(predictor.probability(p, r.session.tokens, token))
    assert obs[-3] == pytest.approx(np.mean(env.view.next_p), abs=1e-6)  # the first of the three entries: their mean
