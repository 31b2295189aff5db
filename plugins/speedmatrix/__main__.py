"""`python -m speedmatrix`: the command (cli.entry)."""

# Guarded: Airflow's plugin manager imports every module under plugins/ (this one included)
# in each component; an unguarded main() would parse the component's argv and exit it.
if __name__ == "__main__":
    try:
        from speedmatrix.cli import entry

        entry()  # never returns; an interrupt before its own handling starts lands below
    except KeyboardInterrupt:  # while importing, or before the command can catch it
        import sys

        try:
            print("speedmatrix: interrupted", file=sys.stderr)
        finally:
            raise SystemExit(130) from None
