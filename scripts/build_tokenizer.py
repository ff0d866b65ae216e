"""Rebuild the GPT-2 byte-level BPE tokenizer offline, for the `tiny-random` model pair.

The ranks come from ``whisper/assets/gpt2.tiktoken`` in the MIT-licensed ``openai-whisper``
source distribution on PyPI (the same 50,256 BPE ranks as GPT-2 and OPT). The script fetches
that sdist with ``pip download`` (a package registry, not the model hub), converts the ranks
with transformers' ``TikTokenConverter`` (needs ``pip install tiktoken``), adds
``<|endoftext|>`` as id 50256, checks the result against tiktoken on sample text, and writes
``bild_env/assets/gpt2-tokenizer/``. Run it only to regenerate the committed files:

    python -m scripts.build_assets tokenizer
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

WHISPER = "openai-whisper==20250625"
GPT2_PATTERN = r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
EOS = "<|endoftext|>"
SAMPLES = [
    "Speculative decoding lets a small draft model propose tokens.",
    "  Leading spaces, numbers 12345 and ünïcödé — dashes! \n\nNew paragraph.\t tab",
    "It's what they'd've done; we'll see. <|endoftext|>",
]


def fetch_ranks(workdir: Path) -> Path:
    """Download the openai-whisper sdist and return the path of its gpt2.tiktoken file."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", WHISPER, "-d", str(workdir)],
        check=True,
    )
    (sdist,) = workdir.glob("openai_whisper-*.tar.gz")
    with tarfile.open(sdist) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith("whisper/assets/gpt2.tiktoken"))
        tar.extract(member, workdir, filter="data")
    return workdir / member.name


def build(ranks_file: Path, out: Path) -> None:
    import tiktoken
    from tiktoken.load import load_tiktoken_bpe
    from tokenizers import pre_tokenizers
    from transformers import GPT2TokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    backend = TikTokenConverter(vocab_file=str(ranks_file), pattern=GPT2_PATTERN).converted()
    # GPT-2's own pre-tokenizer: byte-level with its built-in regex.
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok = GPT2TokenizerFast(tokenizer_object=backend, eos_token=EOS, bos_token=EOS, unk_token=EOS)
    assert tok.convert_tokens_to_ids(EOS) == 50256, "<|endoftext|> must be id 50256"

    ranks = load_tiktoken_bpe(str(ranks_file))
    ref = tiktoken.Encoding("gpt2", pat_str=GPT2_PATTERN, mergeable_ranks=ranks, special_tokens={EOS: 50256})
    for text in SAMPLES:
        ours = tok(text, add_special_tokens=False)["input_ids"]
        theirs = ref.encode(text, allowed_special="all")
        assert ours == theirs, f"tokenizer mismatch on {text!r}: {ours} != {theirs}"
        assert tok.decode(ours) == text
    tok.save_pretrained(out)
    print(f"wrote {out} ({len(tok)} tokens), identical to tiktoken on {len(SAMPLES)} samples")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "bild_env/assets/gpt2-tokenizer")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        build(fetch_ranks(Path(tmp)), args.out)

