"""Rule report_inputs (workflow/rules/report.smk): write the report's inputs, the text its params hold."""

from pathlib import Path

text = snakemake.params.text  # noqa: F821 - Snakemake's script directive defines `snakemake`
Path(snakemake.output[0]).write_text(text)  # noqa: F821
with open(snakemake.log[0], "w") as log:  # noqa: F821
    print(f"{snakemake.output[0]}: {len(text)} characters", file=log)  # noqa: F821
