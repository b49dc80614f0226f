"""Text in and out of the engine: prompt encoding with a size check that needs no tokenisation, incremental
detokenisation, and stop strings.

Encoding runs on the caller's thread (a Serve handler's worker thread, a job actor's coroutine), never on the engine
thread: a 20 MB prompt must cost its sender time, not every other stream. Before anything is tokenised, a prompt's
UTF-8 size is compared with what the context can hold: no token of this vocabulary spans more than
``max_token_bytes`` bytes, so a text longer than ``room * max_token_bytes`` bytes cannot fit ``room`` tokens and is
refused at once.

Output text is decoded incrementally (a window of the last tokens per step, as TGI and vLLM do), so a long answer
costs O(new tokens) per step instead of re-decoding the whole output every step.
"""
from __future__ import annotations

import functools
import logging
import re

from eagle_ray.engine.request import Prompt, parse_prompt
from eagle_ray.errors import InvalidRequestError, PromptTooLongError

log = logging.getLogger(__name__)


def max_token_bytes(tokenizer) -> int:
    """The most UTF-8 bytes any single token decodes to (an upper bound: byte-level BPE maps a byte to one
    character of at most 2 bytes, SentencePiece marks a space with a 3-byte character)."""
    vocab = tokenizer.get_vocab()
    longest = max((len(t.encode("utf-8", "surrogatepass")) for t in vocab), default=1)
    return max(1, longest)


class TextCodec:
    """Prompt -> token ids for one tokenizer and context size."""

    def __init__(self, tokenizer, vocab_size: int, split_special_tokens: bool = False,
                 template_variables: dict | None = None):
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.template_variables = dict(template_variables or {})   # ``model.chat_template_kwargs``
        self.split_special_tokens = split_special_tokens   # chat content's special-token text stays plain text
        self.max_token_bytes = max_token_bytes(tokenizer)
        if len(tokenizer) > vocab_size:
            log.warning("the tokenizer has %d tokens but the model embeds %d: prompts holding the others are refused",
                        len(tokenizer), vocab_size)

    def encode(self, prompt, room: int | None = None, keep_last: int | None = None) -> list[int]:
        """Token ids of ``prompt`` (str, chat messages, token ids or a parsed :class:`Prompt`); with ``room``,
        a prompt that cannot fit is refused before it is tokenised when its size alone proves it. ``keep_last``:
        only the prompt's last this many tokens are kept (vLLM's ``truncate_prompt_tokens``; -1: ``room``), so its
        size proves nothing."""
        p = parse_prompt(prompt)
        if keep_last is not None:
            keep_last = room if keep_last == -1 else keep_last
            ids = self.encode(p)[-keep_last:] if keep_last else self.encode(p)
            return self.encode(Prompt("tokens", ids), room)
        if p.kind == "tokens":
            bad = [t for t in p.value if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidRequestError(f"token ids {bad[:5]} are outside the vocabulary [0, {self.vocab_size})")
            ids = list(p.value)
        else:
            if room is not None and p.kind == "messages" and len(p.value) > room:   # before templating them all
                raise PromptTooLongError(
                    f"the chat has {len(p.value)} messages: more than the {room} tokens the engine fits, and each "
                    "message takes at least one; shorten the chat or raise max_model_len")
            if room is not None:
                size = (len(p.value.encode("utf-8")) if p.kind == "text"
                        else sum(len(m["content"].encode("utf-8")) for m in p.value))
                if size > room * self.max_token_bytes:
                    raise PromptTooLongError(
                        f"prompt is {size} bytes: more than {room} tokens of at most {self.max_token_bytes} bytes "
                        f"each, the most this engine fits; shorten the prompt or raise max_model_len")
            ids = self._tokenize(p)
            if not ids:   # a tokenizer that strips or splits on whitespace: nothing would start the sequence
                raise InvalidRequestError("the prompt encodes to no tokens")
            top = max(ids)
            if top >= self.vocab_size:   # a tokenizer with more tokens than the model has embedding rows
                raise InvalidRequestError(
                    f"the prompt encodes to token id {top}, outside the model's vocabulary "
                    f"[0, {self.vocab_size}): its tokenizer holds tokens the model has no embedding for; leave them "
                    "out of the prompt")
        if room is not None and len(ids) > room:
            raise PromptTooLongError(
                f"prompt has {len(ids)} tokens but the engine fits at most {room} (max_model_len minus the verify "
                "budget); shorten the prompt or raise max_model_len")
        return ids

    def _tokenize(self, p: Prompt) -> list[int]:
        """Tokenizer and chat-template failures (a template that requires alternating roles, say) are the
        request's fault: reported as such instead of failing the batch."""
        if p.kind != "text" and not (self.tokenizer.chat_template or p.template):
            raise InvalidRequestError("the target's tokenizer has no chat template: send the prompt as text or "
                                      "token ids, or give the engine one (model.chat_template)")
        try:
            if p.kind == "text":
                return list(self.tokenizer(p.value)["input_ids"])
            options = {**self.template_variables, **(p.variables or {}),
                       "add_generation_prompt": p.generation_prompt, "continue_final_message": p.continue_final}
            if self.split_special_tokens and p.variables and self._special_text_in(p.variables):
                raise InvalidRequestError("chat_template_kwargs: a value holds special-token text, which the "
                                          "template would render as control tokens; remove that text")
            if self.split_special_tokens and self._special_text_in(
                    [list(p.tools or []), list(p.documents or []),
                     [{k: v for k, v in m.items() if k not in ("role", "content")} for m in p.value]]):
                raise InvalidRequestError("tools, tool calls or documents hold special-token text, which the "
                                          "template would render as control tokens; remove that text")
            if p.tools:
                options["tools"] = [dict(t) for t in p.tools]
            if p.documents:
                options["documents"] = [dict(d) for d in p.documents]
            if p.template:   # a trusted request's own, in transformers' sandboxed Jinja
                options["chat_template"] = p.template
            shown = None
            if p.tools or p.documents or any("tool_calls" in m for m in p.value):
                shown = self._check_shows_tools(p.value, options)
            if self.split_special_tokens and self._forges_special_tokens(p.value):
                return self._chat_with_plain_content(p.value, options)
            if shown is not None and self._tokenizes_rendered_text:
                # the check's text, tokenised as apply_chat_template tokenises its own (a tokenizers backend;
                # mistral-common's tokenises its messages itself)
                return list(self.tokenizer(shown, add_special_tokens=False)["input_ids"])
            return list(self.tokenizer.apply_chat_template(p.value, tokenize=True, return_dict=True,
                                                           **options)["input_ids"])
        except InvalidRequestError:
            raise
        except Exception as e:  # noqa: BLE001
            raise InvalidRequestError(f"cannot tokenize the prompt: {type(e).__name__}: {e}") from None


    @functools.cached_property
    def _tokenizes_rendered_text(self) -> bool:
        from transformers import PreTrainedTokenizerFast
        return isinstance(self.tokenizer, PreTrainedTokenizerFast)

    def _check_shows_tools(self, messages, options: dict) -> str:
        """A template that ignores ``tools``, or earlier calls, would leave the model unaware of them: refused, not
        passed over. Returns the prompt's text, rendered with both."""
        def text(msgs, opts) -> str:
            return self.tokenizer.apply_chat_template(msgs, tokenize=False, **opts)
        shown = text(messages, options)
        for given in ("tools", "documents"):
            if given in options and shown == text(messages, {k: v for k, v in options.items() if k != given}):
                raise InvalidRequestError(f"{given}: this model's chat template does not show {given} to the model; "
                                          "give the deployment a template that does (model.chat_template)")
        if any("tool_calls" in m for m in messages) and shown == text(
                [{k: v for k, v in m.items() if k != "tool_calls"} for m in messages], options):
            raise InvalidRequestError("messages: this model's chat template does not show earlier tool calls to the "
                                      "model; give the engine a template that does (model.chat_template)")
        return shown

    def bad_word_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word's token ids as vLLM reads them: the word, and the word after a space where that starts
        with another token (a word in the middle of the text); ids past the model's vocabulary are refused."""
        if len(words) > MAX_BAD_WORDS:
            raise InvalidRequestError(f"bad_words: at most {MAX_BAD_WORDS} words, got {len(words)}")
        out: list[list[int]] = []
        for word in words:
            if not word.strip():
                raise InvalidRequestError("bad_words: a word of whitespace alone bars nothing; leave it out")
            plain = list(self.tokenizer(word.lstrip(), add_special_tokens=False)["input_ids"])
            if len(plain) > MAX_BAD_WORD_TOKENS:
                raise InvalidRequestError(f"bad_words: {word[:40]!r} is {len(plain)} tokens, more than the "
                                          f"{MAX_BAD_WORD_TOKENS} a word may be")
            spaced = list(self.tokenizer(" " + word.lstrip(), add_special_tokens=False)["input_ids"])
            out += [plain] + ([spaced] if spaced and spaced[0] != plain[0] and len(spaced) == len(plain) else [])
        out = [ids for ids in out if ids]
        bad = [t for ids in out for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"bad_words: a word encodes to token id {bad[0]}, outside the model's "
                                      f"vocabulary [0, {self.vocab_size})")
        return out

    @functools.cached_property
    def _special_tokens(self) -> list[str]:
        """The texts of the tokenizer's special tokens (fixed once it is loaded)."""
        return [t for t in self.tokenizer.all_special_tokens + [
            t.content for t in self.tokenizer.added_tokens_decoder.values() if t.special] if t]

    def _forges_special_tokens(self, messages) -> bool:
        return any(tok in m["content"] for m in messages for tok in self._special_tokens)

    def _special_text_in(self, value) -> bool:
        """A request's template variables (a JSON value) hold special-token text in a key or string anywhere."""
        if isinstance(value, str):
            return any(tok in value for tok in self._special_tokens)
        if isinstance(value, dict):
            return any(self._special_text_in(k) or self._special_text_in(v) for k, v in value.items())
        if isinstance(value, list):
            return any(self._special_text_in(v) for v in value)
        return False

    def _chat_with_plain_content(self, messages, options: dict) -> list[int]:
        """The chat templated as usual, but each message's content tokenised with special-token text split into
        ordinary tokens: ``"hi<|im_end|>\n<|im_start|>system"`` in a user message cannot open a system turn.
        (Only chats whose content holds such text come here; the others tokenise exactly as the template says.)"""
        text = self.tokenizer.apply_chat_template(
            [m | {"content": f"\ue000{i}\ue001"} for i, m in enumerate(messages)], tokenize=False, **options)
        found = [int(m.group(1)) for m in MARK.finditer(text)]
        if sorted(found) != list(range(len(messages))):   # a template that drops or repeats a message's content
            raise InvalidRequestError("this chat template does not place each message's content once, so content "
                                      "holding special-token text cannot be kept plain; remove that text")
        ids: list[int] = []
        for i, (before, text) in zip(found, _split_at_marks(text)):
            ids += self.tokenizer(before, add_special_tokens=False)["input_ids"]
            ids += self.tokenizer(messages[i]["content"], add_special_tokens=False,
                                  split_special_tokens=True)["input_ids"]
        return ids + self.tokenizer(text, add_special_tokens=False)["input_ids"]


MARK = re.compile("\ue000(\\d+)\ue001")   # where a message's content sits in a rendered chat


def _split_at_marks(text: str):
    """(text before the mark, the rest after it) for each mark in the order the template placed them."""
    while (m := MARK.search(text)) is not None:
        yield text[: m.start()], text[m.end():]
        text = text[m.end():]


MAX_BAD_WORDS, MAX_BAD_WORD_TOKENS = 128, 32   # what one request's bad words may hold: each step matches them all

# prompt tokens an output's first window is decoded after (vLLM primes its detokenizer with 5 likewise)
PRIMER_TOKENS = 5


class Detokenizer:
    """Incremental text of one output: ``add(ids)`` returns the new text since the last call.

    Decodes only the window ``ids[prefix:]`` and subtracts the text of ``ids[prefix:read]``: a token whose text
    depends on its neighbours (a leading space, half a UTF-8 character) is settled once the window shows it. Where
    the window ends in an incomplete character, the text before it is given now (``shown`` counts it) and only the
    incomplete character waits for the tokens that complete it, however many steps end inside one.

    The first window also holds the prompt's last tokens (``primer``): a SentencePiece decoder strips the space of
    the first token it decodes, so ``▁Paris`` alone is "Paris" but " Paris" after the prompt, which is the text the
    output adds to it. A primer that ends inside a character is not used.
    """

    def __init__(self, tokenizer, prompt_ids=(), skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []   # the output's ids
        self.text = ""
        self.prefix = 0   # window start
        self.read = 0     # tokens whose text is already in self.text
        self.shown = 0    # characters of the window past ids[prefix:read]'s text already in self.text
        self.primer = list(prompt_ids[-PRIMER_TOKENS:])
        self.primer_text = self._decode(self.primer)
        if self.primer_text.endswith("\ufffd"):
            self.primer, self.primer_text = [], ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _window(self, start: int, end: int | None = None) -> str:
        """Text of ``ids[start:end]``; from the output's start, what it adds to the primer's text (decoded alone
        where a tokenizer's clean-up rewrites the primer's own text)."""
        if start or not self.primer:
            return self._decode(self.ids[start:end])
        text = self._decode(self.primer + self.ids[:end])
        return text[len(self.primer_text):] if text.startswith(self.primer_text) else self._decode(self.ids[:end])

    def add(self, ids: list[int]) -> str:
        self.ids.extend(ids)
        before = self._window(self.prefix, self.read)
        window = self._window(self.prefix)
        whole = not window.endswith("\ufffd")
        settled = len(before) + self.shown
        new = (window if whole else window.rstrip("\ufffd"))[settled:]
        if whole and len(window) > len(before):
            self.prefix, self.read, self.shown = self.read, len(self.ids), 0
        else:
            self.shown += len(new)
        self.text += new
        return new

    def text_of(self, tokens: int) -> str:
        """The text of the output's first ``tokens`` tokens."""
        return self._window(0, tokens)

    def tokens_reaching(self, chars: int) -> int:
        """The fewest tokens whose text is longer than ``chars`` characters (binary search: a handful of
        decodes, once per request). Cuts the tokens at a stop string."""
        lo, hi = 1, len(self.ids)
        while lo < hi:
            mid = (lo + hi) // 2
            if len(self._window(0, mid)) > chars:
                hi = mid
            else:
                lo = mid + 1
        return lo

    def truncate(self, tokens: int, chars: int) -> None:
        del self.ids[tokens:]
        self.text = self.text[:chars]
        self.prefix = self.read = len(self.ids)
        self.shown = 0


class StopStrings:
    """Finds the first stop string in text that grows at its end (searching only where a new match can start)."""

    def __init__(self, stops: list[str]):
        self.stops = [s for s in stops if s]
        self.longest = max((len(s) for s in self.stops), default=0)

    def find(self, text: str, new_chars: int, floor: int = 0) -> tuple[int, int] | None:
        """(start, end) in ``text`` of the earliest stop string that ends in the last ``new_chars`` characters and
        past the first ``floor`` (the text of a request's first ``min_tokens`` tokens, where no stop counts)."""
        if not self.stops or not new_chars:
            return None
        start = max(0, len(text) - new_chars - self.longest + 1)
        hits = [(i, i + len(s)) for s in self.stops if (i := text.find(s, max(start, floor - len(s) + 1))) >= 0]
        return min(hits) if hits else None

    @property
    def hold(self) -> int:
        """Characters a stream holds back: they may still become the start of a stop string."""
        return max(0, self.longest - 1)
