"""The tokenised preference pair, the tokenised unpaired example and the group
(one prompt, several completions): the data types the data layer, the
objectives and the trainer share."""

from dataclasses import dataclass
from typing import Optional


@dataclass
class Pair:
    """One preference example as token ids.

    `chosen` and `rejected` are whole sequences (prompt followed by the
    response); the first `*_prompt_len` tokens of each are the prompt. When the
    two prompts tokenise identically the prompt can be encoded once for both.
    """

    chosen: list
    rejected: list
    chosen_prompt_len: int
    rejected_prompt_len: int

    def shares_prompt(self):
        n = self.chosen_prompt_len
        return n == self.rejected_prompt_len and self.chosen[:n] == self.rejected[:n]

    def validate(self, where="pair"):
        """Raises ValueError for an empty response or an out-of-range prompt length."""
        for name, seq, n in (
            ("chosen", self.chosen, self.chosen_prompt_len),
            ("rejected", self.rejected, self.rejected_prompt_len),
        ):
            if not 0 <= n <= len(seq):
                raise ValueError(
                    f"{where}: {name}_prompt_len={n} is outside [0, {len(seq)}]"
                )
            if len(seq) - n < 1:
                raise ValueError(f"{where}: the {name} response is empty")


@dataclass
class Example:
    """One unpaired example (KTO) as token ids: a prompt followed by a
    completion, and whether the completion is desirable."""

    tokens: list
    prompt_len: int
    label: bool
    # The completion KTO's KL estimate pairs this prompt with (another example's,
    # fixed when the data is loaded); None: the batch's rotation (see `kto`).
    kl_completion: Optional[list] = None

    def completion(self):
        return self.tokens[self.prompt_len:]

    def as_pair(self, rejected=None):
        """A Pair whose chosen side is this example (and whose rejected side is
        `rejected`, tokens after the same prompt, or the example again)."""
        other = self.tokens if rejected is None else self.tokens[:self.prompt_len] + list(rejected)
        return Pair(self.tokens, other, self.prompt_len, self.prompt_len)

    def validate(self, where="example"):
        if not isinstance(self.label, bool):
            raise ValueError(f"{where}: label must be true or false, got {self.label!r}")
        self.as_pair().validate(where)
        if self.kl_completion is not None and not (isinstance(self.kl_completion, list) and self.kl_completion):
            raise ValueError(f"{where}: kl_completion must be None or a non-empty list of tokens")


@dataclass
class Group:
    """One prompt and its completions as token ids (GRPO's group; a pair whose
    prompts agree is a group of two). The prompt is encoded once for all of them."""

    prompt: list
    completions: list

    def sequences(self):
        return [list(self.prompt) + list(c) for c in self.completions]

    def validate(self, where="group"):
        """Raises ValueError for an empty prompt, no completions or an empty completion."""
        if not isinstance(self.prompt, (list, tuple)) or not self.prompt:
            # The first completion token is predicted from the prompt's last position.
            raise ValueError(f"{where}: the prompt must be a non-empty list of token ids")
        if not isinstance(self.completions, (list, tuple)) or not self.completions:
            raise ValueError(f"{where}: completions must be a non-empty list")
        for g, c in enumerate(self.completions):
            if not isinstance(c, (list, tuple)) or not c:
                raise ValueError(f"{where}: completions[{g}] must be a non-empty list of token ids")
