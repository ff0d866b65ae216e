"""An acceptance head per draft: the chance that the target's greedy token equals the draft's proposal.

SpecDec++ and DISCO stop drafting on a small classifier instead of the draft's own max probability. The head
here reads, at each position the draft proposes a token for (its argmax, among the restricted head's columns
where the draft has one, ``bild_env.models.draft_head``):

- hidden states of the draft, ``HeadSpec.layers``: layer i in 1..L-1 is decoder layer i's output (the residual
  stream), layer L the final normed state (the output layer's input; ``capture_final_hidden`` reads it from any
  forward, the lean one included, at no cost);
- scalars, ``HeadSpec.scalars`` (``SCALARS``): the draft's max probability, its entropy (nats) and top-2 margin
  (probability), the depth in the draft block (0 for the first proposal after a target forward), the target's max
  probability at the last verified position, and the request's running acceptance (hits + 1) / (proposals + 2)
  over the proposals verified so far;

standardised by the TRAIN split's mean and spread, then a logistic regression (``width`` 0) or one hidden layer.
``distill.acceptance`` (``python -m distill acceptance``) collects the features, fits the head, and compares it
with the max probability on held-out prompts. A decoder scores one forward's proposals with::

    head = load_head(folder, pair.draft, draft_key(pair.fingerprints[0], pair.draft_vocab))
    with capture_final_hidden(pair.draft) as finals, proposal_logits(pair.draft) as ids:
        z = single_forward(pair.draft, row)                   # (n, K) logits
    p = head.score([finals[-1][0, -z.shape[0]:]], z, depth, target_max_prob, running_acceptance)   # (n,)

A head that reads layers below the last needs them from the forward (``hidden_from_outputs`` with
``output_hidden_states=True``; the lean forward does not run the layer modules). ``load_head`` refuses, with a
message saying what to do, a missing file and a head made for another draft (hidden size, layers, weights).
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

HEAD_FILE = "acceptance_head.pt"  # not *.safetensors: beside a draft it would enter the draft's fingerprint
SCALARS: tuple[str, ...] = ("max_prob", "entropy", "margin", "depth", "target_max_prob", "running_acceptance")


class HeadMismatchError(ValueError):
    """An acceptance head that is missing or was made for another draft; the message says what to do."""


@dataclass(frozen=True)
class HeadSpec:
    """What a head reads and its shape (saved with its weights)."""

    hidden_size: int  # the draft's hidden size H
    num_layers: int  # the draft's decoder layers L
    layers: tuple[int, ...] = ()  # hidden states read: 1..L-1 a decoder layer's output, L the final normed state
    scalars: tuple[str, ...] = SCALARS  # of SCALARS, in this order
    width: int = 0  # hidden units of the one hidden layer; 0: logistic regression
    draft: str = ""  # ``draft_key`` of the draft it was fitted on ("" = not checked)
    notes: dict = field(default_factory=dict, compare=False)  # how it was made (free form, saved)

    def __post_init__(self) -> None:
        object.__setattr__(self, "layers", tuple(int(i) for i in self.layers))
        object.__setattr__(self, "scalars", tuple(self.scalars))
        bad_layers = [i for i in self.layers if not 1 <= i <= self.num_layers]
        bad_scalars = [s for s in self.scalars if s not in SCALARS]
        if bad_layers or bad_scalars or self.width < 0 or not (self.layers or self.scalars):
            raise ValueError(f"HeadSpec: layers must lie in 1..{self.num_layers} (got {bad_layers}), scalars among "
                             f"{SCALARS} (got {bad_scalars}), width >= 0 (got {self.width}), and something read")

    @property
    def n_features(self) -> int:
        return len(self.layers) * self.hidden_size + len(self.scalars)


def draft_key(fingerprint: str, draft_vocab: str = "") -> str:
    """What names a draft for its head: ``ModelPair.fingerprints[0]`` and ``ModelPair.draft_vocab`` (the proposals
    change with the restricted head)."""
    return f"{fingerprint}|draft-vocab={draft_vocab or 'full'}"


def confidence(logits: torch.Tensor) -> dict[str, torch.Tensor]:
    """The draft's max probability, entropy (nats) and top-2 margin (probability) per row of ``logits`` (n, C), each (n,)
    float32; columns at -inf (a restricted head spread over the vocabulary) count as probability 0."""
    logp = torch.log_softmax(logits.float(), -1)
    p = logp.exp()
    top = p.topk(2, -1).values
    entropy = -(p * logp.masked_fill(p == 0, 0.0)).sum(-1)
    return {"max_prob": top[:, 0], "entropy": entropy, "margin": top[:, 0] - top[:, 1]}


def draft_features(spec: HeadSpec, hidden: Sequence[torch.Tensor], logits: torch.Tensor, depth: torch.Tensor,
                   target_max_prob: torch.Tensor, running_acceptance: torch.Tensor) -> torch.Tensor:
    """The head's input (n, ``spec.n_features``) float32 for n proposals.

    ``hidden``: one (n, H) tensor per ``spec.layers``, in that order; ``logits`` (n, C) the draft's at those positions;
    ``depth``, ``target_max_prob``, ``running_acceptance``: (n,) each (see the module's docstring).
    """
    if len(hidden) != len(spec.layers) or any(h.shape[-1] != spec.hidden_size for h in hidden):
        raise HeadMismatchError(f"the head reads {len(spec.layers)} hidden state(s) of size {spec.hidden_size} "
                                f"(layers {spec.layers}); got sizes {[tuple(h.shape) for h in hidden]}")
    scalars = confidence(logits) | {"depth": depth, "target_max_prob": target_max_prob,
                                    "running_acceptance": running_acceptance}
    columns = [h.float().reshape(-1, spec.hidden_size) for h in hidden]
    columns += [scalars[name].float().reshape(-1, 1).to(logits.device) for name in spec.scalars]
    return torch.cat(columns, -1)


class AcceptanceHead(torch.nn.Module):
    """P(target's greedy token == the draft's proposal) from ``draft_features``: standardise, then a logistic
    regression or one hidden layer (GELU)."""

    def __init__(self, spec: HeadSpec) -> None:
        super().__init__()
        self.spec = spec
        n = spec.n_features
        self.register_buffer("mean", torch.zeros(n))
        self.register_buffer("std", torch.ones(n))
        self.net = (torch.nn.Linear(n, 1) if spec.width == 0 else
                    torch.nn.Sequential(torch.nn.Linear(n, spec.width), torch.nn.GELU(), torch.nn.Linear(spec.width, 1)))

    def set_scale(self, features: torch.Tensor) -> None:
        """Standardise by the mean and spread of ``features`` (N, F) (the TRAIN split's)."""
        self.mean.copy_(features.mean(0))
        self.std.copy_(features.std(0).clamp_min(1e-6))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        """Logits (n,) of acceptance for ``features`` (n, F)."""
        return self.net((features - self.mean) / self.std)[:, 0]

    @torch.inference_mode()
    def probability(self, features: torch.Tensor) -> torch.Tensor:
        """P(accept) (n,) for ``features`` (n, F)."""
        return torch.sigmoid(self(features))

    def score(self, hidden: Sequence[torch.Tensor], logits: torch.Tensor, depth: torch.Tensor,
              target_max_prob: torch.Tensor, running_acceptance: torch.Tensor) -> torch.Tensor:
        """P(accept) (n,) of n proposals: ``probability(draft_features(...))`` (the arguments as there)."""
        return self.probability(draft_features(self.spec, hidden, logits, depth, target_max_prob, running_acceptance))


@contextmanager
def capture_final_hidden(model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """Within it, every forward of ``model`` appends its output layer's input (B, n, H), the final normed hidden
    states (layer L of ``HeadSpec``), to the list it yields. A hook on the output layer: the lean forward too."""
    captured: list[torch.Tensor] = []
    handle = model.get_output_embeddings().register_forward_pre_hook(lambda _m, args: captured.append(args[0]))
    try:
        yield captured
    finally:
        handle.remove()


def hidden_from_outputs(spec: HeadSpec, hidden_states: Sequence[torch.Tensor], final: torch.Tensor) -> list[torch.Tensor]:
    """The hidden states ``spec.layers`` names, from a forward's ``hidden_states`` (embeddings, layer 1, ..., as
    transformers returns them with ``output_hidden_states=True``) and ``final`` (``capture_final_hidden``'s), each
    shaped like ``final``."""
    return [final if i == spec.num_layers else hidden_states[i] for i in spec.layers]


def draft_shape(model: torch.nn.Module) -> tuple[int, int]:
    """(hidden size, decoder layers) of a transformers causal LM."""
    config = model.config
    return int(config.hidden_size), int(config.num_hidden_layers)


def save_head(head: AcceptanceHead, path: str | Path) -> Path:
    """Write ``head`` (weights and spec) to ``path`` (a folder gets ``HEAD_FILE``); returns the file."""
    path = Path(path)
    path = path / HEAD_FILE if path.is_dir() or not path.suffix else path
    path.parent.mkdir(parents=True, exist_ok=True)
    state = {k: v.detach().cpu().contiguous() for k, v in head.state_dict().items()}
    torch.save({"spec": json.dumps(asdict(head.spec)), "state": state}, path)
    return path


def load_head(path: str | Path, draft: torch.nn.Module | None = None, key: str = "") -> AcceptanceHead:
    """The head saved at ``path`` (a file, or a folder holding ``HEAD_FILE``), on the CPU, in eval mode.

    With ``draft`` (the draft model) and ``key`` (its ``draft_key``), raises ``HeadMismatchError`` unless the head
    was made for that hidden size, number of layers and draft; always for a missing or unreadable file.
    """
    path = Path(path)
    path = path / HEAD_FILE if path.is_dir() else path
    if not path.is_file():
        raise HeadMismatchError(f"no acceptance head at {path}: fit one with `python -m distill acceptance --pair "
                                "<pair>`, or score by the draft's max probability")
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
        spec = json.loads(saved["spec"])
        spec = HeadSpec(**spec | {"layers": tuple(spec["layers"]), "scalars": tuple(spec["scalars"])})
    except Exception as err:  # a truncated or foreign file: say which, not a pickle traceback
        raise HeadMismatchError(f"{path} is not an acceptance head ({type(err).__name__}: {err})") from err
    if draft is not None:
        check_matches(spec, draft, key, path)
    head = AcceptanceHead(spec)
    head.load_state_dict(saved["state"])
    return head.eval().requires_grad_(False)


def check_matches(spec: HeadSpec, draft: torch.nn.Module, key: str = "", where: object = "the head") -> None:
    """``HeadMismatchError`` unless ``spec`` was made for ``draft`` (hidden size, layers) and, when both are known,
    for the draft named ``key``."""
    hidden, layers = draft_shape(draft)
    problems = []
    if (spec.hidden_size, spec.num_layers) != (hidden, layers):
        problems.append(f"it reads hidden size {spec.hidden_size} and {spec.num_layers} layers, the draft has "
                        f"hidden size {hidden} and {layers} layers")
    if key and spec.draft and key != spec.draft:
        problems.append(f"it was fitted on draft {spec.draft!r}, this one is {key!r}")
    if problems:
        raise HeadMismatchError(f"{where} does not match this draft: {'; '.join(problems)}. Fit a head for this draft "
                                "with `python -m distill acceptance --pair <pair>`")
