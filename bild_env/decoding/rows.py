"""BiLD's rules and the logits' readouts for B rows at once (tensor operations, no loop over requests): what
``bild_env.decoding.batched.BatchedDecoder`` applies to its batch (``first_rollback_rows`` is ``bild.first_rollback``
row-wise; a test holds them equal)."""

from __future__ import annotations

import torch


def first_rollback_rows(distances: torch.Tensor, draft_tokens: torch.Tensor, target_argmax: torch.Tensor,
                        pending: torch.Tensor, rollback_threshold: torch.Tensor) -> torch.Tensor:
    """``bild.first_rollback`` for B requests at once: the index of each row's first draft token to undo.

    ``distances`` (B, D) nats, ``draft_tokens`` and ``target_argmax`` (B, D); row r's first ``pending[r]``
    entries are real. A token is rolled back when its distance exceeds the row's threshold (B,) AND it
    differs from the target's choice. Returns (B,) long: the index, or ``pending[r]`` where none is.
    """
    real = torch.arange(distances.shape[1], device=distances.device) < pending[:, None]
    flag = real & (distances > rollback_threshold[:, None]) & (draft_tokens != target_argmax)
    return torch.where(flag.any(1), flag.to(torch.int8).argmax(1), pending)


def draft_readout_rows(z: torch.Tensor, rows: torch.Tensor,
                       ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``kv.draft_readout`` for the rows in ``rows`` (B,) of logits ``z`` (B, V): each row's argmax (B,) and
    max softmax probability exp(z_max - logsumexp(z)) (B,) float64; 0 and 0.0 for the other rows. ``ids``
    (V,): the token id of each column (a restricted head's, ``draft_head.proposal_logits``); None: column = id."""
    index = rows.nonzero()[:, 0]
    z = z[index]
    z_max, arg = z.max(-1)
    if ids is not None:
        arg = ids[arg]
    token = torch.zeros(rows.shape[0], dtype=torch.long, device=z.device)
    p = torch.zeros(rows.shape[0], dtype=torch.float64, device=z.device)
    token[index] = arg
    p[index] = torch.exp(z_max - torch.logsumexp(z, -1)).double()
    return token, p


def verify_readout(z: torch.Tensor, drafts: torch.Tensor, pending: torch.Tensor):
    """``kv.target_readout`` for a batch: what the verification reads from the target's logits z (B, N, V).

    Row r was fed its last committed token and its ``pending[r]`` drafts (``drafts`` (B, D), D = N - 1),
    right-aligned; draft j sits at column N - pending + j and is judged by the logits one column before.
    Returns the argmax of every column (B, N), and per draft (B, D): the target's choice there, ``logp``
    = log p_L(draft) and ``top`` = log p_L(target's choice) in nats, float64 (0 where j >= pending).
    The vocabulary-wide log-sum-exp runs on the real drafts only (not on padding).
    """
    B, N, _ = z.shape
    D = N - 1
    values, argmax = z.max(-1)
    logp = torch.zeros((B, D), dtype=torch.float64, device=z.device)
    top = torch.zeros_like(logp)
    if not D:
        return argmax, argmax[:, :0], logp, top
    j = torch.arange(D, device=z.device)
    col = (N - 1 - pending[:, None] + j).clamp(max=N - 2)
    rows, js = (j < pending[:, None]).nonzero(as_tuple=True)
    cols = col[rows, js]
    zk = z[rows, cols]  # (K, V): the logits judging each real draft token
    lse = torch.logsumexp(zk, -1)
    logp[rows, js] = (zk.gather(1, drafts[rows, js, None])[:, 0] - lse).double()
    top[rows, js] = (values[rows, cols] - lse).double()
    return argmax, argmax.gather(1, col), logp, top


def feed_rows(tokens: torch.Tensor, start: torch.Tensor, end: torch.Tensor):
    """Row r's tokens ``tokens[r, start[r]:end[r]]`` right-aligned in N = max(end - start) columns.

    Returns ids (B, N) (pads 0), which columns are real (B, N) bool, position ids (B, N) and N.
    """
    N = int((end - start).max())
    index = end[:, None] - N + torch.arange(N, device=tokens.device)  # the token index of each column
    real = index >= start[:, None]
    index = index.clamp(min=0)
    return tokens.gather(1, index) * real, real, index, N
