# shapewise evidence pipeline. Run `snakemake --cores all`; see README.md.
#
# The global name `workflow` below is Snakemake's own object; our Python is the
# package `shapewise` in workflow/shapewise/ (imported from this checkout first;
# its subpackages shapewise.model and shapewise.kernels are model/ and kernels/).

import sys

sys.path.insert(0, f"{workflow.basedir}/workflow")

from snakemake.utils import min_version, validate

min_version("9.0")


configfile: "config/config.yaml"


validate(config, "workflow/schemas/config.schema.yaml")


include: "workflow/rules/common.smk"
include: "workflow/rules/measure.smk"
include: "workflow/rules/report.smk"


rule all:
    input:
        "results/report/report.md",
        "results/report/report.html",
        "results/report/summary.csv",
        "results/report/provenance.json",
    default_target: True
