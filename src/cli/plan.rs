//! `torpor plan`'s arguments (the planner and `plan calibrate`).

use std::path::PathBuf;

use clap::{Args, Subcommand};

use super::ClientArgs;

#[derive(Debug, Args)]
#[command(args_conflicts_with_subcommands = true)]
pub struct PlanCommand {
    #[command(subcommand)]
    pub action: Option<PlanAction>,
    #[command(flatten)]
    pub run: PlanArgs,
}

#[derive(Debug, Subcommand)]
pub enum PlanAction {
    /// Measure this host's create, wake and hibernate latencies and
    /// snapshot size per dirty MiB with probe sandboxes, through the REST
    /// API of a running `torpor serve`; store them for `torpor plan`.
    Calibrate(CalibrateArgs),
}

#[derive(Debug, Args)]
pub struct PlanArgs {
    /// The activity trace (JSON lines; see docs/operators.md).
    #[arg(long, value_name = "FILE")]
    pub trace: Option<PathBuf>,
    /// The pod's physical memory for sandboxes, in GiB.
    #[arg(long, value_name = "G")]
    pub pod_mem_gib: Option<f64>,
    /// Oversubscription ratios to compare.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "1,2,4,8",
        value_name = "R,..."
    )]
    pub ratios: Vec<f64>,
    /// Keep-alives (idle time before hibernation) to compare, in ms.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "300000",
        value_name = "MS,..."
    )]
    pub keep_alive_ms: Vec<u64>,
    /// High watermarks (fraction of the pod's memory) to compare.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "0.9",
        value_name = "W,..."
    )]
    pub watermarks: Vec<f64>,
    /// Cores the pod's creates, wakes and hibernations share.
    #[arg(long, default_value_t = 2, value_name = "N")]
    pub pod_cores: u32,
    /// How often the policy runs (as `serve --policy-interval-ms`).
    #[arg(long, default_value_t = 1000, value_name = "MS")]
    pub policy_interval_ms: u64,
    /// The calibration to cost events with [default: DATA_DIR/plan-calibration.json
    /// if it exists, else the built-in default].
    #[arg(long, value_name = "FILE")]
    pub calibration: Option<PathBuf>,
    /// The pod's disk write bandwidth, MiB/s, which hibernations' snapshot
    /// writes share [default: the calibration's].
    #[arg(long, value_name = "MIB_S")]
    pub disk_mib_s: Option<f64>,
    /// The data directory whose calibration is used by default.
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// Target: the wake p99 requests may see, in ms.
    #[arg(long, default_value_t = 100.0, value_name = "MS")]
    pub target_wake_p99_ms: f64,
    /// Target: the most creates and wakes that may be refused, in %.
    #[arg(long, default_value_t = 1.0, value_name = "PCT")]
    pub max_reject_pct: f64,
    /// Print the plan as JSON.
    #[arg(long)]
    pub json: bool,
    /// Write the chart (SVG) to this file.
    #[arg(long, value_name = "FILE")]
    pub svg: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct CalibrateArgs {
    #[command(flatten)]
    pub client: ClientArgs,
    /// Samples per figure.
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=200))]
    pub samples: u32,
    /// Memory of the probe sandboxes, MiB.
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(16..=4096))]
    pub mem_mib: u32,
    /// What the dirtying probe rewrites, MiB (less than --mem-mib).
    #[arg(long, default_value_t = 64, value_parser = clap::value_parser!(u32).range(1..=2048))]
    pub dirty_mib: u32,
    /// The service's data directory, to read snapshot sizes from
    /// [default: the default data directory].
    #[arg(long, value_name = "DIR")]
    pub data_dir: Option<PathBuf>,
    /// Where to store the calibration [default: DATA_DIR/plan-calibration.json].
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
}
