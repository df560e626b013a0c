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


# Before any job: the config, then (common.smk) every selected manifest. An
# unknown key, e.g. a typo on --config, is named on one line (the schema's
# own error would print the whole schema and config after it).
def _unknown_config_keys():
    import difflib

    import yaml
    from shapewise.paths import CONFIG_SCHEMA

    known = sorted(yaml.safe_load(CONFIG_SCHEMA.read_text())["properties"])
    problems = []
    for key in sorted(set(config) - set(known)):
        close = difflib.get_close_matches(key, known, n=1)
        problems.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    if problems:
        raise WorkflowError(f"unknown config key {', '.join(problems)} in --config or config/config.yaml; "
                            f"the keys are: {', '.join(known)}")


_unknown_config_keys()
validate(config, "workflow/schemas/config.schema.yaml")


include: "workflow/rules/common.smk"
include: "workflow/rules/gpus.smk"
include: "workflow/rules/measure.smk"
include: "workflow/rules/report.smk"


rule all:
    input:
        rules.report.output,
        # every per-shape result too: one deleted by hand is scheduled again (the report's outputs are kept
        # on failure, so Snakemake would not look behind them for a missing input)
        RESULT_TARGETS,
    default_target: True
