"""`roll serve RECIPE`: the Tinker training API on this machine (docs/serve.md)."""

from __future__ import annotations

from roll_cli.common import Debug, DryRun, Overrides, Recipe, handle_errors, out
from roll_core.tracking.terminal import print_table


@handle_errors
def serve_command(
    recipe: Recipe,
    overrides: Overrides = None,
    dry_run: DryRun = False,
    debug: Debug = False,
) -> None:
    """Serve the Tinker API (tinker, tinker-cookbook) for the recipe's models: LoRA training
    and sampling on this machine. Point clients at it with TINKER_BASE_URL."""
    from roll_core.config import dump_config
    from roll_core.config.serve_loader import load_serve_recipe
    from roll_core.serve import serve, serve_plan

    cfg = load_serve_recipe(recipe, overrides or [])
    if dry_run:
        out.print(dump_config(cfg).rstrip("\n"), markup=False, highlight=False)
        print_table(out, "serve plan", ("part", "detail"), serve_plan(cfg))
        out.print("[green]recipe is valid[/green] (dry run: no model loaded, nothing served)")
        return

    def ready(url: str) -> None:
        out.print(f"serving the Tinker API at {url}", markup=False, highlight=False)
        out.print(
            f"  export TINKER_BASE_URL={url} TINKER_API_KEY=tml-local",
            markup=False,
            highlight=False,
        )

    serve(cfg, on_ready=ready)
