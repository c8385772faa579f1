"""The GPU bring-up kit's parts (bench/gpu_check.sh runs them): each measures or checks one piece of the GPU path
and records what ran, what was skipped and why, in one JSON file per part under the output folder."""
