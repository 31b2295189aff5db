"""`python -m speedmatrix`: the command, whose Ctrl-C is an interrupt from its first import to
its exit (exit code 130, one line), not a traceback and -2 when it lands while importing."""

# Guarded: Airflow's plugin manager imports every module under plugins/ (this one included)
# in each component; an unguarded main() would parse the component's argv and exit it.
if __name__ == "__main__":
    import sys

    try:
        from speedmatrix.cli import main
        from speedmatrix.cli.interrupts import EXIT_INTERRUPTED, interrupted, note_only

        rc = main()
    except KeyboardInterrupt:  # while importing, before main catches it
        try:
            print("speedmatrix: interrupted", file=sys.stderr)
        finally:
            raise SystemExit(130) from None
    note_only()
    raise SystemExit(EXIT_INTERRUPTED if interrupted() else rc)
