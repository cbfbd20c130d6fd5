"""When each row of a generate() call stops (EOS, stop strings, transformers StoppingCriteria, max_new_tokens),
what the streamer receives, and the call's output once its rows have stopped; the options that say so
(`Stopping`) and their checks.

Both decode loops (r2lm.generation.decoding, r2lm.generation.verify) end the same way through a `Stopper`: EOS
checked on every step's tokens (`check_eos`), the text that every row has final checked for stop strings and
criteria and streamed (`advance`), the output trimmed after each row's stop (`output`). What stays theirs: when
text is final (decode: a whole block; verify: the text the slowest row has), and how wide the output is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from r2lm.checks import token_list
from r2lm.generation.outputs import GenerateOutput


@dataclass(frozen=True)
class Stopping:
    """eos_ids stop a row (once no [MASK] precedes them); pad_id fills a row after its stop; stop_strings (read
    with the tokenizer) and stopping_criteria are checked on the text; the streamer receives committed tokens."""

    eos_ids: list[int]
    pad_id: int
    mask_id: int
    stop_strings: list[str] = field(default_factory=list)
    tokenizer: object = None
    stopping_criteria: list = field(default_factory=list)
    streamer: object = None

    @classmethod
    def of(cls, options: dict, config, mask_id: int) -> Stopping:
        eos = token_list("eos_token_id", options.get("eos_token_id", config.eos_token_id), config.vocab_size)
        pad_id = options.get("pad_token_id", config.pad_token_id)
        if pad_id is None:
            pad_id = eos[0] if eos else 0
        pad_id = token_list("pad_token_id", pad_id, config.vocab_size)[0]
        if mask_id in eos:  # every [MASK] still to decode would read as an EOS
            raise ValueError(f"eos_token_id includes the mask token id {mask_id}")
        stop_strings = options.get("stop_strings") or []
        if isinstance(stop_strings, str):
            stop_strings = [stop_strings]
        if not all(isinstance(s, str) and s for s in stop_strings):
            raise ValueError(f"stop_strings must be non-empty strings, got {stop_strings!r}")
        tokenizer = options.get("tokenizer")
        if stop_strings and tokenizer is None:
            raise ValueError("stop_strings need the tokenizer (pass tokenizer=...)")
        criteria = options.get("stopping_criteria") or []
        if callable(criteria):
            criteria = [criteria]
        if not all(callable(c) for c in criteria):
            raise ValueError("stopping_criteria must be transformers StoppingCriteria (callables returning a bool per "
                             "row)")
        return cls(eos, pad_id, mask_id, stop_strings, tokenizer, criteria, options.get("streamer"))


class Stopper:
    """Per-row stopping under the `Stopping` options `r`. `stop_at[row]` is the number of generated tokens the row
    keeps (-1 while running). The streamer receives the `prompt` first, as transformers' generate sends it."""

    def __init__(self, r: Stopping, prompt: torch.Tensor, prompt_mask: torch.Tensor, every_token: bool = False):
        batch, device = prompt.shape[0], prompt.device
        self.eos = torch.tensor(r.eos_ids, dtype=torch.long, device=device)
        self.pad_id, self.mask_id = r.pad_id, r.mask_id
        self.stop_strings, self.tokenizer, self.streamer = r.stop_strings, r.tokenizer, r.streamer
        self.criteria = r.stopping_criteria
        self.stop_at = torch.full((batch,), -1, dtype=torch.long, device=device)
        self.checked = 0  # generated tokens [0, checked) of every row have been searched for stop strings
        # stopping criteria are called on the text after every token with `every_token` (verified decoding, whose
        # output is AR's: AR decoding calls them so), else once per block; tokens [0, judged) have been judged
        self.every_token, self.judged = every_token, 0
        # A stop string may begin in the prompt and end in the generated text (transformers' StopStringCriteria
        # reads the whole sequence): each row keeps the prompt's last tokens, as many as the longest stop string
        # has characters (a token spells at least one)
        width = max(map(len, self.stop_strings), default=0)
        self.prompt_tails = [row[keep.bool()].tolist()[-width:] for row, keep in zip(prompt, prompt_mask, strict=True)
                             ] if width else []
        self.streamed = 0  # generated tokens [0, streamed) of every row have been streamed
        self.stream(prompt)

    @property
    def finished(self) -> torch.Tensor:
        return self.stop_at >= 0

    @property
    def reads_text(self) -> bool:
        """Whether `advance` has anything to do: stop strings, criteria or a streamer."""
        return bool(self.stop_strings or self.criteria or self.streamer)

    def check_eos(self, block: torch.Tensor, start, rows: torch.Tensor | None = None) -> None:
        """Rows whose block (generated tokens [start, start + L); `start` an int or per row) holds an EOS with no
        [MASK] before it stop after that EOS; their still-masked positions become padding (nothing left to decode).
        `rows`: the batch indices of the block's rows when only some rows are still decoding. No host sync."""
        if not self.eos.numel():
            return
        is_eos = torch.isin(block, self.eos)
        cols = torch.arange(block.shape[1], device=block.device)
        first = torch.where(is_eos, cols, block.shape[1]).min(dim=1).values
        clear = ~((block == self.mask_id) & (cols < first[:, None])).any(dim=1)
        stop_at = self.stop_at if rows is None else self.stop_at[rows]
        stop_at = torch.where(is_eos.any(dim=1) & clear & (stop_at < 0), start + first + 1, stop_at)
        if rows is None:
            self.stop_at = stop_at
        else:
            self.stop_at = self.stop_at.index_copy(0, rows, stop_at)
        block.masked_fill_((stop_at >= 0)[:, None] & (block == self.mask_id), self.pad_id)

    def end_block(self, sequences: torch.Tensor, prompt_len: int, end: int) -> bool:
        """After a block is final (generated tokens [0, end) of sequences [B, prompt_len + n]): stop strings and
        stopping criteria, on the text so far. Returns whether there were any to check."""
        if not self.stop_strings and not self.criteria:
            return False
        new = sequences[:, prompt_len : prompt_len + end]
        if self.stop_strings:
            # running rows, and rows an EOS stopped after the text searched so far: a stop string may complete
            # before that EOS (the earlier stop wins, as in transformers' generate)
            unsearched = ~self.finished | (self.stop_at > self.checked)
            for row in torch.nonzero(unsearched).flatten().tolist():
                stop = int(self.stop_at[row])
                tokens = new[row, : end if stop < 0 else min(stop, end)].tolist()
                if self._stops_within(row, tokens):
                    self.stop_at[row] = next(k for k in range(1, len(tokens) + 1) if self._stops_within(row, tokens[:k]))
            self.checked = end
        for length in range(self.judged + 1, end + 1) if self.every_token else [end]:
            for criterion in self.criteria:
                done = criterion(self.trim(sequences[:, : prompt_len + length], prompt_len), None)
                done = torch.as_tensor(done, device=self.stop_at.device).expand(self.stop_at.shape)
                # a row whose EOS (or stop string) comes after `length` was still decoding there
                running = ~self.finished | (self.stop_at > length)
                self.stop_at = torch.where(done & running, length, self.stop_at)
        self.judged = end
        return True

    def advance(self, sequences: torch.Tensor, prompt_len: int, end: int) -> bool:
        """Generated tokens [0, end) of every row of sequences [B, prompt_len + >= end] are final: stop strings and
        criteria on them (`end_block`), and the tokens not streamed yet to the streamer. Returns whether there were
        stops to check."""
        checked = self.end_block(sequences, prompt_len, end)
        self.stream(sequences[:, prompt_len + self.streamed : prompt_len + end], self.streamed)
        self.streamed = end
        return checked

    def _stops_within(self, row: int, tokens: list[int]) -> bool:
        """Whether a stop string ends within the text of generated `tokens` (it may begin in the prompt)."""
        tail = self.prompt_tails[row]
        head = len(self.tokenizer.decode(tail)) if tail else 0
        text = self.tokenizer.decode(tail + tokens)
        return any(text.find(s, max(0, head - len(s) + 1)) >= 0 for s in self.stop_strings)

    def trim(self, sequences: torch.Tensor, prompt_len: int) -> torch.Tensor:
        """Sequences with every generated token after each row's stop replaced by padding."""
        cols = torch.arange(sequences.shape[1], device=sequences.device) - prompt_len
        after = self.finished[:, None] & (cols >= self.stop_at[:, None])
        return sequences.masked_fill(after, self.pad_id)

    def count(self, n: int) -> int:
        """Generated tokens kept, summed over rows, when `n` were decoded per row."""
        return int(torch.where(self.finished, self.stop_at.clamp(max=n), n).sum())

    def stream(self, tokens: torch.Tensor, start: int | None = None) -> None:
        """Send tokens to the streamer: the prompt (`start` None), or generated tokens [start, start + L) that are
        final; for a single row, only the tokens before its stop."""
        if self.streamer is None:
            return
        if start is not None:
            if tokens.shape[0] == 1 and self.finished[0]:
                tokens = tokens[:, : max(0, int(self.stop_at[0]) - start)]
            else:
                cols = start + torch.arange(tokens.shape[1], device=tokens.device)
                tokens = tokens.masked_fill(self.finished[:, None] & (cols >= self.stop_at[:, None]), self.pad_id)
        if tokens.numel():
            self.streamer.put(tokens.cpu())

    def output(self, sequences: torch.Tensor, prompt_len: int, nfe: int, steps: int, row_steps) -> GenerateOutput:
        """The call's output once it has decoded generated tokens [0, end) of sequences [B, prompt_len + end]: the
        stream ended, every row padded after its stop, its tokens counted up to its stop. `row_steps` may be a
        tensor: it is read here, once."""
        if self.streamer is not None:
            self.streamer.end()
        return GenerateOutput(sequences=self.trim(sequences, prompt_len), nfe=nfe, steps=steps,
                              new_tokens=self.count(sequences.shape[1] - prompt_len), row_steps=int(row_steps))
