"""The demo model's corpus: templated ChatML dialogues, generated from a seed, nothing copied from elsewhere.

Five topics: greetings, arithmetic (``What is 17 plus 25?`` -> ``17 plus 25 is 42.``), spelling
(``How do you spell cat?`` -> ``cat is spelled c-a-t.``), weekdays and months (``What day comes after
Monday?`` -> ``The day after Monday is Tuesday.``), and facts about pagedserve. A fixed split holds out
some number pairs, some words and some (question wording, day) combinations: training never sees them,
``held_out_questions`` asks only them, so a right answer there is generalisation, not recall.
"""
from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass
from functools import cache

SPLIT_SEED = 20240917  # fixes the held-out split; the training stream has its own seed
MAX_OPERAND = 99
HELD_OUT_PAIR_FRACTION = 0.06
HELD_OUT_WORD_FRACTION = 0.12
README_PAIR = ("plus", 17, 25)  # the README's example question: held out, so its answer is not memorised

Message = dict[str, str]

ARITHMETIC_QUESTIONS = {
    "plus": ["What is {a} plus {b}?", "What's {a} plus {b}?", "How much is {a} plus {b}?", "Compute {a} plus {b}.",
             "What is {a} + {b}?", "Add {a} and {b}.", "{a} plus {b}?", "Please add {a} and {b}."],
    "minus": ["What is {a} minus {b}?", "What's {a} minus {b}?", "How much is {a} minus {b}?",
              "Compute {a} minus {b}.", "What is {a} - {b}?", "Subtract {b} from {a}.", "{a} minus {b}?",
              "Please subtract {b} from {a}."],
}
SPELLING_QUESTIONS = ["How do you spell {w}?", "Spell {w}.", "Spell the word {w}.", "How is {w} spelled?",
                      "Can you spell {w}?", "Please spell {w}."]
# Deliberately none of the words the other templates use, so a held-out word appears nowhere in training.
WORDS = """
apple baby bag ball bank bath bear bed bell bike bird boat bone book boot bowl box bread brick bridge brush
bus cake camp candle car card cart cat chair chalk cheese chest child chin city clock cloud coat corn cow crab
cup dance desk dog doll door dream dress drum duck dust egg farm fence field fish flag floor flower fog foot
fork fox frog fruit game garden gate gift girl glass glove goat gold grape grass hair hand hat hill horse
house ice ink jam jar jelly jump kettle key king kite knee lake lamp leaf leg lemon light lion lip map milk
moon mouse mud nail neck nest net night nose nut oak ocean orange owl paint pan paper park pear pen pencil
pig pillow pipe plant plate pond pot queen rabbit rain ring river road rock roof room root rope rose salt
sand sea seed sheep shelf ship shirt shoe shop silk sink skirt sky snake snow sock soup spoon star stone
storm street sugar sun table tail tea tent tiger toe tooth towel town toy train tree truck van vase wall
watch water wave whale wheel wind window wing winter wolf wood wool worm yard zebra zoo
""".split()
DAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
CALENDAR_QUESTIONS = ["What {unit} comes {direction} {x}?", "Which {unit} is {direction} {x}?",
                      "What is the {unit} {direction} {x}?", "Name the {unit} {direction} {x}.",
                      "Tell me the {unit} that comes {direction} {x}.", "What {unit} is {direction} {x}?"]
GREETING = "Hello! I am the pagedserve demo model. I can add and subtract, spell words, and name days and months."
GREETINGS = [(["Hello", "Hi", "Hey", "Hello there", "Hi there", "Good morning", "Good evening", "Greetings"],
              GREETING),
             (["How are you?", "How are you doing?", "How is it going?"],
              "I am fine, thank you. Ask me a sum, like: what is 12 plus 30?"),
             (["Thank you", "Thanks", "Thanks a lot", "Thank you very much"], "You are welcome!"),
             (["Bye", "Goodbye", "See you later", "Good night"], "Goodbye! Have a nice day."),
             (["Who are you?", "What are you?", "What is your name?"],
              "I am the pagedserve demo model: a tiny Llama trained on templated dialogues."),
             (["What can you do?", "Help", "What do you know?"],
              "I can add and subtract numbers up to 99, spell simple words, and name the day or month that "
              "comes before or after another.")]
FACTS = [(["What is pagedserve?", "Tell me about pagedserve.", "What does pagedserve do?"],
          "pagedserve is an LLM serving engine built on PagedAttention, with an OpenAI-compatible API."),
         (["What is PagedAttention?", "Explain PagedAttention.", "How does PagedAttention work?"],
          "PagedAttention keeps the KV cache in fixed-size blocks, like pages of virtual memory, so requests "
          "waste almost no memory and can share blocks."),
         (["What is the block size?", "What is the default block size?", "How many tokens fit in a block?"],
          "By default a KV block holds 16 tokens."),
         (["What is the KV cache?", "Why does pagedserve need a KV cache?"],
          "The KV cache stores the keys and values of earlier tokens so each new token is computed only once."),
         (["How does pagedserve batch requests?", "What is continuous batching?"],
          "pagedserve uses continuous batching: new requests join the running batch at every step."),
         (["Which API does pagedserve speak?", "Is pagedserve compatible with OpenAI?"],
          "pagedserve speaks the OpenAI API: /v1/completions and /v1/chat/completions, streamed or not."),
         (["How big are you?", "How many layers do you have?", "How many parameters do you have?"],
          "I am a Llama with 4 layers and about 3 million parameters."),
         (["What is Redis used for?", "Why does pagedserve use Redis?"],
          "Gateways and engine workers pass requests and tokens through Redis streams.")]
SYSTEM_PROMPTS = ["You are a helpful assistant.", "You are the pagedserve demo model.", "Answer briefly."]


@dataclass(frozen=True, slots=True)
class Question:
    category: str  # arithmetic | spelling | calendar
    question: str
    answer: str


@cache
def split() -> tuple[frozenset, frozenset, frozenset]:
    """The held-out (op, a, b) pairs, words, and (template index, unit, direction, item) combinations."""
    rng = random.Random(SPLIT_SEED)
    pairs = sorted(_all_pairs())
    held_pairs = set(rng.sample(pairs, round(HELD_OUT_PAIR_FRACTION * len(pairs)))) | {README_PAIR}
    unused = [w for w in WORDS if w not in _fixed_text()]  # "ice" is in "nice": never held out
    held_words = set(rng.sample(unused, round(HELD_OUT_WORD_FRACTION * len(WORDS))))
    # One wording per (unit, direction, item) is held out: the answer is trained, that phrasing of it is not.
    held_calendar = {(rng.randrange(len(CALENDAR_QUESTIONS)), unit, direction, item)
                     for unit, items in (("day", DAYS), ("month", MONTHS))
                     for direction in ("after", "before") for item in items}
    return frozenset(held_pairs), frozenset(held_words), frozenset(held_calendar)


def _fixed_text() -> str:
    """Every fixed sentence of the corpus, lower case."""
    texts = [*ARITHMETIC_QUESTIONS["plus"], *ARITHMETIC_QUESTIONS["minus"], *SPELLING_QUESTIONS, *CALENDAR_QUESTIONS,
             GREETING, *SYSTEM_PROMPTS, *(t for qs, a in GREETINGS + FACTS for t in [*qs, a]), "is spelled",
             "the day month after before"]
    return " ".join(texts).lower()


def _all_pairs() -> set[tuple[str, int, int]]:
    numbers = range(MAX_OPERAND + 1)
    return {("plus", a, b) for a in numbers for b in numbers} | {("minus", a, b) for a in numbers for b in numbers
                                                                 if a >= b}


def arithmetic_answer(op: str, a: int, b: int) -> str:
    return f"{a} {op} {b} is {a + b if op == 'plus' else a - b}."


def spelling_answer(word: str) -> str:
    return f"{word} is spelled {'-'.join(word)}."


def calendar_answer(unit: str, direction: str, item: str) -> str:
    items = DAYS if unit == "day" else MONTHS
    step = 1 if direction == "after" else -1
    return f"The {unit} {direction} {item} is {items[(items.index(item) + step) % len(items)]}."


def calendar_question(template: int, unit: str, direction: str, item: str) -> str:
    return CALENDAR_QUESTIONS[template].format(unit=unit, direction=direction, x=item)


def held_out_questions() -> list[Question]:
    """Every held-out question, in its plainest wording for arithmetic and spelling, in a fixed order."""
    held_pairs, held_words, held_calendar = split()
    arithmetic = [Question("arithmetic", ARITHMETIC_QUESTIONS[op][0].format(a=a, b=b), arithmetic_answer(op, a, b))
                  for op, a, b in sorted(held_pairs)]
    spelling = [Question("spelling", SPELLING_QUESTIONS[0].format(w=w), spelling_answer(w)) for w in sorted(held_words)]
    calendar = [Question("calendar", calendar_question(*c), calendar_answer(*c[1:])) for c in sorted(held_calendar)]
    return arithmetic + spelling + calendar


class Corpus:
    """An endless, seeded stream of training dialogues (lists of ChatML messages), none of them held out."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        held_pairs, held_words, self.held_calendar = split()
        self.pairs = sorted(_all_pairs() - held_pairs)
        self.words = sorted(set(WORDS) - held_words)
        self.topics = [(self.arithmetic, 0.55), (self.spelling, 0.2), (self.calendar, 0.13), (self.greeting, 0.06),
                       (self.fact, 0.06)]

    def __iter__(self) -> Iterator[list[Message]]:
        while True:
            yield self.dialogue()

    def dialogue(self) -> list[Message]:
        """One to three exchanges, sometimes after a system prompt; only the assistant turns are learnt."""
        rng = self.rng
        messages = [{"role": "system", "content": rng.choice(SYSTEM_PROMPTS)}] if rng.random() < 0.1 else []
        for _ in range(rng.choice((1, 1, 1, 2, 3))):
            make = rng.choices([t for t, _ in self.topics], weights=[w for _, w in self.topics])[0]
            question, answer = make()
            messages += [{"role": "user", "content": self._vary(question)}, {"role": "assistant", "content": answer}]
        return messages

    def _vary(self, question: str) -> str:
        """Users type carelessly: sometimes all lower case, or without the final punctuation."""
        if self.rng.random() < 0.15:
            question = question.lower()
        if self.rng.random() < 0.1 and question[-1] in "?.":
            question = question[:-1]
        return question

    def arithmetic(self) -> tuple[str, str]:
        op, a, b = self.rng.choice(self.pairs)
        return self.rng.choice(ARITHMETIC_QUESTIONS[op]).format(a=a, b=b), arithmetic_answer(op, a, b)

    def spelling(self) -> tuple[str, str]:
        word = self.rng.choice(self.words)
        return self.rng.choice(SPELLING_QUESTIONS).format(w=word), spelling_answer(word)

    def calendar(self) -> tuple[str, str]:
        rng = self.rng
        while True:
            unit, items = rng.choice((("day", DAYS), ("month", MONTHS)))
            combo = (rng.randrange(len(CALENDAR_QUESTIONS)), unit, rng.choice(("after", "before")), rng.choice(items))
            if combo not in self.held_calendar:
                return calendar_question(*combo), calendar_answer(*combo[1:])

    def greeting(self) -> tuple[str, str]:
        questions, answer = self.rng.choice(GREETINGS)
        return self.rng.choice(questions), answer

    def fact(self) -> tuple[str, str]:
        questions, answer = self.rng.choice(FACTS)
        return self.rng.choice(questions), answer


def render(messages: list[Message]) -> str:
    """ChatML as the demo chat template writes plain messages (tests check the two agree)."""
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
