"""Workloads for bench/bench_speculative.py: input-grounded tasks over a given passage, and open-ended chat.

Input-grounded: correct, rewrite, summarise or extract from a passage given in the prompt (200-400 prompt
tokens with the embedded model's chat template), the work where prompt lookup pays: the answer reuses the
passage's words. No prompt asks to copy the passage. Open-ended: questions whose answers are not in the prompt.
Structured: extraction from a passage into JSON under a JSON schema (structured outputs).
"""

from __future__ import annotations

PASSAGES = (
    "The Great Barrier Reef is the worlds largest coral reef system, composed of over 2,900 individual reefs and "
    "900 islands streching for over 2,300 kilometres over an area of aproximately 344,400 square kilometres. The "
    "reef is located in the Coral Sea, off the coast of Queensland, Australia. It can be seen from outer space and "
    "is the world's biggest single structure made by living organisms. This reef structure is composed of and built "
    "by billions of tiny organisms, known as coral polyps. It supports a wide diversity of life and was selected as a "
    "World Heritage Site in 1981. In 2006 the Queensland National Trust named it a state icon of Queensland.",
    "Marie Curie was born in Warsaw in 1867 and moved to Paris in 1891 to study physics and mathematics at the "
    "University of Paris. There she met Pierre Curie, whom she married in 1895. Together they discovered two new "
    "elements, polonium and radium, and in 1903 they shared the Nobel Prize in Physics with Henri Becquerel for "
    "their work on radioactivity. After Pierre died in a street accident in 1906, Marie took over his teaching post, "
    "becoming the first woman to teach at the University of Paris. In 1911 she recieved a second Nobel Prize, this "
    "time in Chemistry, for isolating pure radium. She died in 1934 of aplastic anaemia, most likely caused by her "
    "long exposure to radiation.",
    "The city council met on Tuesday evening to discuss the new public transport plan. The plan adds three bus "
    "lines, extends the tram network by 12 kilometres and introduces a single ticket that is valid on buses, trams "
    "and trains for 90 minutes. The council estimates the cost at 48 million euros over four years, of which the "
    "national government will pay 30 million. Several residents spoke against the plan, saying that the new tram "
    "line would remove 200 parking spaces from the city centre. The mayor replied that a survey of 1,500 residents "
    "had found that 62 percent supported the plan. The council will vote on the plan on the 14th of March.",
    "To replace a bicycle inner tube, first remove the wheel from the frame by opening the quick release lever or "
    "loosening the axle nuts. Let out any remaining air by pressing the valve core. Use two tyre levers to lift one "
    "side of the tyre over the rim, then pull the old tube out. Check the inside of the tyre carefully for glass, "
    "thorns or sharp stones, because whatever caused the puncture may still be there. Inflate the new tube slightly "
    "so that it holds its shape, push the valve through the hole in the rim and tuck the tube into the tyre. Push the "
    "tyre back onto the rim with your thumbs, inflate it to the pressure printed on the sidewall and refit the wheel.",
)

TASKS = (
    "Correct the spelling and grammar mistakes in the following passage and return the corrected passage:",
    "Rewrite the following passage in the past tense where it is in the present tense, keeping every fact:",
    "Extract every number in the following passage, each on its own line with the phrase it belongs to:",
    "Rewrite the following passage as a numbered list of short factual statements, in the same order:",
)

OPEN_ENDED = (
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are some good habits for staying healthy while working from home?",
    "Explain how a rainbow forms, for a ten-year-old.",
    "Give me ideas for a birthday party for my grandmother who likes gardening.",
    "Why do cats purr? Tell me what scientists think.",
    "Describe a walk through a busy market in the morning.",
    "What should I consider when choosing my first programming language?",
    "Write a poem about autumn leaves.",
)


def input_grounded() -> list[list[dict[str, str]]]:
    """One conversation per (task, passage): 16 prompts."""
    return [[{"role": "user", "content": f"{task}\n\n{passage}"}] for task in TASKS for passage in PASSAGES]


def open_ended() -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": question}] for question in OPEN_ENDED]


FACTS_SCHEMA = {
    "type": "object",
    "properties": {"topic": {"type": "string"}, "facts": {"type": "array", "items": {"type": "string"}, "minItems": 3}},
    "required": ["topic", "facts"],
}


def structured_extraction() -> list[list[dict[str, str]]]:
    """One conversation per passage, answered under FACTS_SCHEMA: 4 prompts."""
    task = ("Extract the facts stated in the following passage as JSON: a short topic, then each fact as one "
            "sentence in the passage's own words.")  # fmt: skip
    return [[{"role": "user", "content": f"{task}\n\n{passage}"}] for passage in PASSAGES]
