"""The tokenised preference pair: the one data type the data layer, the
objectives and the trainer share."""

from dataclasses import dataclass


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
