"""The paper's experiments as a tool: policies, memory-limit sweeps, metrics and plots."""

from dualblade.bench.cgroups import CgroupError as CgroupError
from dualblade.bench.cgroups import can_create_memory_cgroups as can_create_memory_cgroups
from dualblade.bench.iobench import IoBenchConfig as IoBenchConfig
from dualblade.bench.iobench import run_iobench as run_iobench
from dualblade.bench.kv_workload import run_kv_workload as run_kv_workload
from dualblade.bench.kv_workload import summarize as summarize
from dualblade.bench.pipebench import run_pipebench as run_pipebench
from dualblade.bench.pipebench_page_cache import (
    run_page_cache_pipebench as run_page_cache_pipebench,
)
from dualblade.bench.plots import write_plots as write_plots
from dualblade.bench.presets import get_bench_preset as get_bench_preset
from dualblade.bench.pressure import pressure_plan as pressure_plan
from dualblade.bench.pressure import run_pressure as run_pressure
from dualblade.bench.serving import ServingPlan as ServingPlan
from dualblade.bench.serving import run_serving as run_serving
from dualblade.bench.serving import serving_plan as serving_plan
from dualblade.bench.serving_command import SERVICE_PRESETS as SERVICE_PRESETS
from dualblade.bench.serving_command import run_service_preset as run_service_preset
from dualblade.bench.serving_requests import RequestSpec as RequestSpec
from dualblade.bench.serving_requests import draw_requests as draw_requests
from dualblade.bench.soak import run_soak as run_soak
from dualblade.bench.soak_options import SoakOptions as SoakOptions
from dualblade.bench.stops import progress_fields as progress_fields
from dualblade.bench.stops import progress_lines as progress_lines
from dualblade.bench.stops import run_keeping as run_keeping
from dualblade.bench.stops import say_stopped as say_stopped
from dualblade.bench.stops import write_whole as write_whole
from dualblade.bench.sweep import Sweep as Sweep
from dualblade.bench.sweep import SweepPlan as SweepPlan
from dualblade.bench.sweep import check_plan as check_plan
from dualblade.bench.sweep_report import aggregate as aggregate
from dualblade.bench.sweep_report import evaluate_claims as evaluate_claims
from dualblade.bench.sweep_report import markdown_table as markdown_table
