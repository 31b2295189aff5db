"""`speedmatrix recipes validate|render|list`."""

from __future__ import annotations

import argparse
import sys

from speedmatrix import recipes, refs
from speedmatrix.words import count


def register(sub: argparse._SubParsersAction, name: str) -> None:
    p = sub.add_parser(name, help="validate, render and list recipes")
    rsub = p.add_subparsers(dest="recipes_command", metavar="ACTION")
    rsub.required = True

    v = rsub.add_parser(
        "validate",
        help="validate recipes; list every problem with file and field",
        description="Validate recipe files (or every *.yaml under the folders given). "
        "Prints each problem as FILE: FIELD: REASON and exits 1 when there is any.",
    )
    v.add_argument(
        "paths",
        nargs="*",
        metavar="PATH",
        help="files or folders (default $SPEEDMATRIX_RECIPES, else include/recipes)",
    )
    v.set_defaults(func=_validate)

    r = rsub.add_parser(
        "render",
        help="print the exact launch command (API key as <redacted>)",
        description="Print the launch command of a recipe at an engine ref, exactly as the "
        "server is started and as the report shows it, with the API key as <redacted>.",
    )
    r.add_argument("recipe", help="recipe id (path under include/recipes without .yaml) or file")
    r.add_argument(
        "--ref", help="engine ref (default: the recipe's): v0.29.0, a commit, pr/N, main"
    )
    r.set_defaults(func=_render)

    ls = rsub.add_parser("list", help="list recipe ids with their schedule flags")
    ls.set_defaults(func=_list)


def _validate(args: argparse.Namespace) -> int:
    paths = args.paths or [str(recipes.recipes_dir())]
    good, problems = recipes.validate_paths(paths)
    for problem in problems:
        print(problem, file=sys.stderr)
    for r in good:
        print(f"ok  {r.id}")
    if problems:
        print(f"{count(len(problems), 'problem')} in {count(len(paths), 'path')}", file=sys.stderr)
        return 1
    return 0


def _render(args: argparse.Namespace) -> int:
    recipe = recipes.load_recipe(args.recipe)
    if args.ref:
        refs.classify_ref(args.ref)
    print(recipe.render_launch_command(args.ref))
    return 0


def _list(args: argparse.Namespace) -> int:
    for rid in recipes.list_recipe_ids():
        try:
            r = recipes.load_recipe(rid)
        except recipes.RecipeError:
            print(f"{rid}  (invalid: run `speedmatrix recipes validate`)")
            continue
        flags = ",".join(
            f
            for f, on in (("nightly", r.schedule.nightly), ("per-commit", r.schedule.per_commit))
            if on
        )
        print(f"{rid}  host={r.schedule.host}  {flags or '-'}")
    return 0
