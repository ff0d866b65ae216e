"""scripts.analysis.agreement: drafts read teacher-forced along the target's own greedy output, per domain."""

from __future__ import annotations

import json

import pytest

from bild_env.models.tiny import ensure_tiny_pair


def test_the_target_as_its_own_draft_agrees_everywhere_and_drafts_share_the_outputs(tmp_path):
    from scripts.analysis import agreement

    out = tmp_path / "agreement.json"
    target = str(ensure_tiny_pair() / "target")
    agreement.main(["--pair", "tiny-random", "--drafts", "", target, "--domains", "prose", "code",
                    "--prompts", "2", "--max-new-tokens", "6", "--out", str(out)])
    result = json.loads(out.read_text())
    for domain in ("prose", "code"):
        rows = result["domains"][domain]["drafts"]
        assert rows[target]["agreement"] == 1.0 and rows[target]["per_prompt"] == [1.0, 1.0]
        assert rows["tiny-random"]["positions"] == rows[target]["positions"] == 2 * 5  # 6 new tokens: 5 draftable
        assert 0.0 <= rows["tiny-random"]["agreement"] < 1.0  # the toy draft disagrees somewhere
    assert result["mean_over_domains"][target] == 1.0
    # the TRAIN prompts, as a diagnostic of fit; an unknown split is still refused
    train = agreement.run(agreement.AgreementConfig(pair="tiny-random", drafts=("", target), domains=("prose",),
                                                    split="train", prompts=1, max_new_tokens=4))
    assert train["config"]["split"] == "train" and train["domains"]["prose"]["drafts"][target]["agreement"] == 1.0
    for bad in (["--split", "training"], ["--domains", "poetry"], ["--drafts", str(tmp_path)]):
        with pytest.raises(SystemExit, match="error: "):
            agreement.main(["--pair", "tiny-random", *bad])
