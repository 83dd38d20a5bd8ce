"""Words and language of a text, shared by curation (near-duplicates, phrasing, the profile's
language mix) and evals (a rubric's ``language`` criterion), so both read a text alike.
"""

from __future__ import annotations

import re

_WORD_RE = re.compile(r"\w+", re.UNICODE)


def words(text: str) -> list[str]:
    """The lower-cased word tokens of ``text``."""
    return _WORD_RE.findall(text.lower())


# -- language -------------------------------------------------------------------------------------
# A small stopword vote, enough for the profile's language mix; scripts decide non-Latin text.
_STOP_TEXT: dict[str, str] = {
    "en": "the and is are you to of in it that for with this what how can i my a an on at be "
          "was have has do does not your me we yet any please thanks thank hello hi will would "
          "could should from when where why there here still so no good morning evening",
    "fr": "le la les et est vous de des un une que pour dans je mon pas ce qui ma mes sur avec "
          "au aux du il elle nous votre vos merci bonjour ai suis où mais plus "
          "encore puis pouvez ça très bonsoir salut appelle",
    "es": "el la los las y es usted de un una que para en yo mi por como no se con del al lo "
          "su sus hola gracias favor está estoy puedo pero muy ya todavía mis qué cuándo dónde "
          "me buenos buenas días muchas llamo",
    "de": "der die das und ist sie zu ein eine nicht ich mein mit für wie was den dem des auf "
          "bitte danke hallo noch kann mir meine ihre sich auch habe bin schon wann wo warum "
          "vielen dank können guten tag morgen abend",
    "it": "il lo la gli e è di un una che per con non io mio come sono ho",
    "pt": "o a os as e é de um uma que para com não eu meu como em do da",
    "nl": "de het een en is van ik niet dat voor met mijn hoe wat je zijn",
}
_STOPWORDS = {code: frozenset(text.split()) for code, text in _STOP_TEXT.items()}
_SCRIPTS = (("zh", re.compile(r"[\u4e00-\u9fff]")), ("ja", re.compile(r"[\u3040-\u30ff]")),
            ("ko", re.compile(r"[\uac00-\ud7af]")), ("ru", re.compile(r"[\u0400-\u04ff]")),
            ("ar", re.compile(r"[\u0600-\u06ff]")), ("hi", re.compile(r"[\u0900-\u097f]")))


def language(text: str) -> str:
    """ISO 639-1 guess for ``text`` ("und" when unsure)."""
    sample = text[:2000]
    for code, pattern in _SCRIPTS:
        if code == "zh" and re.search(r"[\u3040-\u30ff]", sample):
            continue  # kana means Japanese even with kanji
        if len(pattern.findall(sample)) >= 3:
            return code
    toks = words(sample)
    votes = {code: sum(1 for t in toks if t in stop) for code, stop in _STOPWORDS.items()}
    if "¿" in sample or "¡" in sample:
        votes["es"] += 2
    ranked = sorted(votes.values(), reverse=True)
    best = max(votes, key=lambda code: votes[code])
    # Two words decide; one decides a short text when no other language has it too.
    return best if ranked[0] >= 2 or (ranked[0] == 1 and ranked[1] == 0) else "und"
