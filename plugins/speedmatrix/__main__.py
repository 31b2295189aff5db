from speedmatrix.cli import main

# Guarded: Airflow's plugin manager imports every module under plugins/ (this one included)
# in each component; an unguarded main() would parse the component's argv and exit it.
if __name__ == "__main__":
    raise SystemExit(main())
