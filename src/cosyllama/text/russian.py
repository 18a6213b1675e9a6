"""Russian numbers in words (our deviation from the reference, which reads them in English).

Applied by :class:`cosyllama.text.normalize.TextNormalizer` to sentences that contain Cyrillic letters,
before wetext. Words come from ``num2words`` (lang "ru"); the patterns below decide which form:

* years before a form of "год" (``в 2023 году``, ``2023 года``, ``1990-х годах``, ``2023 г.``):
  ordinal in the case the noun shows (``году`` after "к" is dative, otherwise prepositional);
* dates ``DD.MM.YYYY``: "шестое мая две тысячи двадцать четвёртого года";
* ordinals written with a suffix (``5-й``, ``2-го``, ``3-я``): case/gender from the suffix;
* percentages: number + "процент/процента/процентов" by the Russian plural rule
  (decimals take "процента");
* times ``HH:MM``; decimals with "." or "," ("три целых четырнадцать сотых"); a leading minus
  sign ("минус"); thousands grouped with no-break or thin spaces;
* any other digit run: a cardinal.

Not inflected (limitations): cardinals and percentages are always nominative, masculine
("с 5 яблоками" → "с пять яблоками", "1 книга" → "один книга", "более 20%" → "более двадцать
процентов"); a 4-digit number without "год" is read as a cardinal; ordinal suffixes that are
ambiguous ("-м" = dative plural or prepositional singular) take the prepositional singular.
"""

from __future__ import annotations

import re
from decimal import Decimal

from num2words import num2words

_MONTHS_GEN = ("января", "февраля", "марта", "апреля", "мая", "июня", "июля", "августа", "сентября",
               "октября", "ноября", "декабря")
_MAX_CARDINAL_DIGITS = 18  # num2words' Russian scale words stop below 10**18
_DIGIT_WORDS = ("ноль", "один", "два", "три", "четыре", "пять", "шесть", "семь", "восемь", "девять")

# case of the ordinal year before each form of "год": (num2words case, plural)
_YEAR_NOUN_CASE = {
    "год": ("n", False), "года": ("g", False), "году": ("p", False), "годом": ("i", False),
    "годе": ("p", False), "годы": ("n", True), "годов": ("g", True), "годах": ("p", True),
    "годам": ("d", True), "годами": ("i", True),
}
# ordinal suffix -> (case, gender, plural); gender "m" also stands for neuter where forms coincide
_ORDINAL_SUFFIX = {
    "й": ("n", "m", False), "ый": ("n", "m", False), "ий": ("n", "m", False), "ой": ("n", "m", False),
    "го": ("g", "m", False), "ого": ("g", "m", False), "его": ("g", "m", False),
    "му": ("d", "m", False), "ому": ("d", "m", False), "ему": ("d", "m", False),
    "м": ("p", "m", False), "ом": ("p", "m", False), "ем": ("p", "m", False),
    "я": ("n", "f", False), "ая": ("n", "f", False), "яя": ("n", "f", False),
    "ю": ("a", "f", False), "ую": ("a", "f", False), "юю": ("a", "f", False),
    "е": ("n", "n", False), "ое": ("n", "n", False), "ее": ("n", "n", False),
    "х": ("g", "m", True), "ых": ("g", "m", True), "их": ("g", "m", True),
    "ми": ("i", "m", True), "ыми": ("i", "m", True), "ими": ("i", "m", True),
}

_NOT_NUM_BEFORE = r"(?<![\d.,])"
_NOT_NUM_AFTER = r"(?![.,]?\d)"
_MINUS = r"(?:(?<![\w-])[-−])?"

_GROUPED_RE = re.compile(r"(?<!\d)\d{1,3}(?:[\u00a0\u202f\u2009]\d{3})+(?!\d)")
_DATE_RE = re.compile(r"(?<![\d.])(\d{1,2})\.(\d{1,2})\.(\d{4})(?!\d)(\s*г\.)?")
_YEAR_RE = re.compile(r"(?<![\d.,])(\d{4})(?:-[а-яё]{1,3})?(\s+)(" + "|".join(
    sorted(_YEAR_NOUN_CASE, key=len, reverse=True)) + r"|г\.)(?![а-яё])", re.IGNORECASE)
_ORDINAL_RE = re.compile(r"(?<![\d.,])(\d+)-(" + "|".join(
    sorted(_ORDINAL_SUFFIX, key=len, reverse=True)) + r")(?![а-яё])", re.IGNORECASE)
_PERCENT_RE = re.compile(_NOT_NUM_BEFORE + "(" + _MINUS + r")(\d+(?:[.,]\d+)?)\s*%")
_TIME_RE = re.compile(r"(?<![\d:])([01]?\d|2[0-3]):([0-5]\d)(?![\d:])")
_DECIMAL_RE = re.compile(_NOT_NUM_BEFORE + "(" + _MINUS + r")(\d+)[.,](\d+)" + _NOT_NUM_AFTER)
_INT_RE = re.compile("(" + _MINUS + r")(\d+)")


def _cardinal(digits: str) -> str:
    if len(digits) > _MAX_CARDINAL_DIGITS:  # beyond num2words' Russian tables: read digit by digit
        return " ".join(_DIGIT_WORDS[int(d)] for d in digits)
    return num2words(int(digits), lang="ru")


def _decimal(number: str) -> str:
    return num2words(Decimal(number.replace(",", ".")), lang="ru")


def _sign(s: str) -> str:
    return "минус " if s else ""


def _percent_noun(number: str) -> str:
    if "." in number or "," in number:
        return "процента"
    n = int(number)
    if 11 <= n % 100 <= 14:
        return "процентов"
    return {1: "процент", 2: "процента", 3: "процента", 4: "процента"}.get(n % 10, "процентов")


def _date(m: re.Match) -> str:
    day, month, year = int(m.group(1)), int(m.group(2)), int(m.group(3))
    if not (1 <= day <= 31 and 1 <= month <= 12):
        return m.group(0)
    words = (f"{num2words(day, lang='ru', to='ordinal', gender='n')} {_MONTHS_GEN[month - 1]} "
             f"{num2words(year, lang='ru', to='ordinal', case='g')}")
    if re.match(r"\s*год", m.string[m.end():], re.IGNORECASE):  # "06.05.2024 года": the noun is already there
        return words
    return words + " года"


def _year(m: re.Match) -> str:
    noun = m.group(3)
    if noun.lower() == "г.":
        before = m.string[:m.start()]
        prepositional = re.search(r"(?:^|\s)(?:в|во|о|об)\s*$", before, re.IGNORECASE)
        case, plural, noun = ("p", False, "году") if prepositional else ("g", False, "года")
        after = m.string[m.end():].lstrip()
        if not after or after[0].isupper():  # the abbreviation's period also ended the sentence
            noun += "."
    else:
        case, plural = _YEAR_NOUN_CASE[noun.lower()]
        if noun.lower() == "году" and re.search(r"(?:^|\s)(?:к|ко)\s*$", m.string[:m.start()], re.IGNORECASE):
            case = "d"
    words = num2words(int(m.group(1)), lang="ru", to="ordinal", case=case, plural=plural, animate=False)
    return f"{words}{m.group(2)}{noun}"


def _ordinal(m: re.Match) -> str:
    case, gender, plural = _ORDINAL_SUFFIX[m.group(2).lower()]
    return num2words(int(m.group(1)), lang="ru", to="ordinal", case=case, gender=gender, plural=plural,
                     animate=False)


def _percent(m: re.Match) -> str:
    number = m.group(2)
    words = _decimal(number) if re.search("[.,]", number) else _cardinal(number)
    return f"{_sign(m.group(1))}{words} {_percent_noun(number)}"


def _time(m: re.Match) -> str:
    hours, minutes = m.group(1), m.group(2)
    mins = "ноль ноль" if minutes == "00" else (
        f"ноль {_cardinal(minutes[1])}" if minutes[0] == "0" else _cardinal(minutes))
    return f"{_cardinal(hours)} {mins}"


def expand_numbers_ru(text: str) -> str:
    """Replace every number in ``text`` with Russian words (see the module docstring for the forms)."""
    text = _GROUPED_RE.sub(lambda m: re.sub(r"\D", "", m.group(0)), text)
    text = _DATE_RE.sub(_date, text)
    text = _YEAR_RE.sub(_year, text)
    text = _ORDINAL_RE.sub(_ordinal, text)
    text = _PERCENT_RE.sub(_percent, text)
    text = _TIME_RE.sub(_time, text)
    text = _DECIMAL_RE.sub(lambda m: _sign(m.group(1)) + _decimal(f"{m.group(2)}.{m.group(3)}"), text)
    return _INT_RE.sub(lambda m: _sign(m.group(1)) + _cardinal(m.group(2)), text)
