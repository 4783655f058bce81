# fetch_extractor: the FID feature extractor, shared by runs under resources/extractors/.
# A local rule: on a cluster the download (inception, dinov2) happens where there is internet access.
# Not used for an extractor given as a path to your own TorchScript file.
localrules:
    fetch_extractor,


rule fetch_extractor:
    output:
        extractor=f"{RESOURCES}/extractors/{{extractor}}.pt",
    log:
        # Shared by runs, so no {run} in the path.
        "logs/fetch_extractor/{extractor}.log",
    benchmark:
        "logs/benchmarks/fetch_extractor/{extractor}.tsv"
    wildcard_constraints:
        extractor=r"inception-2015-12-05|random-seed\d+|dinov2-vit[sblg]14",
    conda:
        "../../envs/diffrelay.yaml"
    threads: 1
    params:
        kind=lambda wildcards: (
            wildcards.extractor
            if wildcards.extractor.startswith("dinov2")
            else wildcards.extractor.split("-")[0]
        ),
        seed=lambda wildcards: (
            wildcards.extractor.removeprefix("random-seed")
            if wildcards.extractor.startswith("random")
            else 0
        ),
    message:
        "Fetching the {params.kind} feature extractor"
    shell:
        "exec >{log:q} 2>&1; PS4=; set -x; "
        "diffrelay fetch-extractor --extractor {params.kind:q} --seed {params.seed:q} "
        "--out {output.extractor:q}"
