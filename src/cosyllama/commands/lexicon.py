"""``cosyllama lexicon``: propose pronunciation entries (``suggest``) and check a lexicon file (``check``);
docs/pronunciation.md."""

from __future__ import annotations


def add_parser(sub) -> None:
    """The ``lexicon`` command's arguments (``sub``: the CLI's sub-parsers)."""
    s = sub.add_parser("lexicon", help="propose pronunciation lexicon entries, check a lexicon file")
    cmds = s.add_subparsers(dest="lexicon_command", required=True)
    g = cmds.add_parser("suggest", help="print proposed entries for a word (pypinyin for Chinese, the CMU "
                                        "dictionary for English), one 'word<TAB>tokens' line each")
    g.add_argument("word", help="the word (Chinese characters or an English word)")
    g.add_argument("--language", choices=("zh", "en"), default=None,
                   help="zh or en (default: zh if the word holds Chinese characters)")
    g.set_defaults(func=run_suggest)
    c = cmds.add_parser("check", help="read a lexicon file and say how many entries it holds, or what is wrong")
    c.add_argument("file", help="the lexicon (word<TAB>tokens lines, or a .json object)")
    c.set_defaults(func=run_check)


def run_suggest(args, out=print) -> int:
    from ..errors import InputError
    from ..text.spellings import suggest

    entries = suggest(args.word, args.language)
    if not entries:
        raise InputError(f"no pronunciation known for {args.word!r}; write the entry by hand "
                         "(docs/pronunciation.md lists the tokens)")
    for e in entries:
        if e.tokens:
            out(f"{e.word}\t{e.spelled}\t# {e.where}")
        else:
            out(f"# {e.word}: {e.where}")
    return 0


def run_check(args, out=print) -> int:
    from ..text.lexicon import Lexicon

    lex = Lexicon.load(args.file)
    out(f"{args.file}: {len(lex)} entries, all tokens known")
    return 0
