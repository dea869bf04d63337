//! `nvmeof-bench`: runs a job file (or `--quick`) in several modes side by side and prints
//! a markdown table; writes JSON (`--json`) and SVG plots (`--svg`).

use std::path::PathBuf;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Parser;
use nvmeof_bench::job::{HostLoad, JobFile, Mode, Overrides, Plan, parse_duration};
use nvmeof_bench::path::HostChoice;
use nvmeof_bench::run::{RunOptions, run};
use nvmeof_bench::{QUICK_JOB, svg};

/// DAS vs NVMe-oF load generator.
///
/// Runs every job of a TOML job file (see benches/jobs/) in each mode, side by side:
///   das            the backend directly, in this process
///   tcp            NVMe/TCP to our target started in this process
///   tcp-bin[=PATH] NVMe/TCP to nvmeof-targetd started as a process
///   tcp=HOST:PORT  NVMe/TCP to any target (with --nqn)
///   rdma=HOST:PORT NVMe/RDMA to any target listening on rdma:// (with --nqn)
///   iscsi          iSCSI to Debian's tgt (tgtd), started here on a RAM-backed LUN
///   iscsi=HOST:PORT iSCSI to any target (with --iqn and --lun)
/// Examples:
///   nvmeof-bench --quick
///   nvmeof-bench benches/jobs/study1-das-vs-of.toml --json out.json --svg plots/
///   nvmeof-bench job.toml --modes das,tcp --target 127.0.0.1:4420 --nqn nqn.2016-06.io.spdk:cnode1
///   nvmeof-bench job.toml --modes das,tcp-bin,iscsi
#[derive(Debug, Parser)]
#[command(name = "nvmeof-bench", version, verbatim_doc_comment)]
struct Args {
    /// The job file (TOML).
    #[arg(required_unless_present_any = ["quick", "print_quick_job"])]
    job: Option<PathBuf>,

    /// DAS vs NVMe/TCP loopback on a memory namespace, in well under a minute.
    #[arg(long, conflicts_with = "job")]
    quick: bool,

    /// Print the job file --quick runs and exit.
    #[arg(long)]
    print_quick_job: bool,

    /// Run only the jobs with these names, comma-separated, in the file's order.
    #[arg(long, value_delimiter = ',', value_name = "NAME")]
    jobs: Option<Vec<String>>,

    /// Modes, comma-separated (replaces the job file's).
    #[arg(long, value_delimiter = ',')]
    modes: Option<Vec<Mode>>,

    /// Plain `tcp` starts this target binary as a separate process.
    #[arg(long, value_name = "PATH", conflicts_with = "target")]
    target_bin: Option<PathBuf>,

    /// Plain `tcp` uses the NVMe/TCP target at this address.
    #[arg(long, value_name = "HOST:PORT")]
    target: Option<String>,

    /// Process ID, on this machine, of the target given by address (--target, tcp=HOST:PORT,
    /// rdma=HOST:PORT or iscsi=HOST:PORT): its CPU time is measured (and --target-cpus pins
    /// it).
    #[arg(long, value_name = "PID")]
    target_pid: Option<u32>,

    /// Subsystem NQN (for --target and tcp=HOST:PORT).
    #[arg(long)]
    nqn: Option<String>,

    /// Target IQN of the iscsi modes (default: the name of the tgt target the load generator
    /// starts).
    #[arg(long)]
    iqn: Option<String>,

    /// First LUN of the iscsi modes (default: 1 on the tgt the load generator starts, 0 on
    /// a target at an address).
    #[arg(long)]
    lun: Option<u16>,

    /// Measured duration of every point (e.g. 10s, 500ms).
    #[arg(long, value_parser = parse_duration)]
    runtime: Option<Duration>,

    /// Warm-up of every point.
    #[arg(long, value_parser = parse_duration)]
    ramp_time: Option<Duration>,

    /// Region of each namespace every job touches (e.g. 64M).
    #[arg(long, value_parser = parse_bytes)]
    size: Option<u64>,

    /// Repeat the whole run N times (medians and spread are reported).
    #[arg(long)]
    repeat: Option<u32>,

    /// Do not check reads against the pattern.
    #[arg(long)]
    no_verify: bool,

    /// Write the verify pattern over the region before a job that reads, in every mode
    /// (replaces `prefill`). By default only the load generator's own storage (das, tcp,
    /// tcp-bin) is prefilled: a target given by address is not written by a read job, and its
    /// reads are verified only after a prefill.
    #[arg(long, overrides_with = "no_prefill")]
    prefill: bool,

    /// Never write the pattern before reading (replaces `prefill`); reads of a target given by
    /// address are then not verified.
    #[arg(long, overrides_with = "prefill")]
    no_prefill: bool,

    /// Host NQN to connect to a target given by address with (default: as the nvmeof CLI,
    /// /etc/nvme/hostnqn, else the one stored in --state-dir).
    #[arg(long, value_name = "NQN")]
    hostnqn: Option<String>,

    /// Where the host identity is stored when /etc/nvme/hostnqn is absent (as the nvmeof CLI;
    /// default: /var/lib/nvmeof for root, else ~/.local/state/nvmeof).
    #[arg(long, env = "NVMEOF_STATE_DIR", value_name = "DIR")]
    state_dir: Option<PathBuf>,

    /// Backend of each namespace (mem:1G, null:1G, file:PATH,size=1G, bdev:PATH).
    #[arg(long)]
    backend: Option<blockdev::BackendSpec>,

    /// Reactor threads of the target the load generator starts.
    #[arg(long)]
    target_reactors: Option<usize>,

    /// Busy-poll window of the started target's reactors in microseconds (0: event-driven;
    /// default: the target's default, 50).
    #[arg(long, value_name = "US")]
    target_poll_us: Option<u32>,

    /// Busy-poll window of the initiator's I/O queues in microseconds (0: event-driven;
    /// default: the initiator's default, 50).
    #[arg(long, value_name = "US")]
    client_poll_us: Option<u32>,

    /// Keep SQ flow control on at Connect (`true`), or ask controllers to disable it
    /// (`false`, the initiator's default).
    #[arg(long, value_name = "BOOL")]
    sq_flow_control: Option<bool>,

    /// Pin the target (reactor threads or process) to these CPUs, e.g. 0.
    #[arg(long, value_name = "LIST")]
    target_cpus: Option<String>,

    /// Pin the client threads to these CPUs, e.g. 1.
    #[arg(long, value_name = "LIST")]
    client_cpus: Option<String>,

    /// Run every point on a busy host (the built-in CPU and memory-bandwidth load).
    #[arg(long)]
    busy: bool,

    /// Threads of the busy-host load.
    #[arg(long)]
    load_threads: Option<u32>,

    /// Write the JSON report here.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,

    /// Write SVG plots into this directory.
    #[arg(long, value_name = "DIR")]
    svg: Option<PathBuf>,

    /// Write the markdown table here too.
    #[arg(long, value_name = "FILE")]
    markdown: Option<PathBuf>,

    /// No per-measurement lines and no progress line on stderr.
    #[arg(short, long)]
    quiet: bool,
}

fn parse_bytes(s: &str) -> Result<u64, String> {
    blockdev::parse_size(s).map_err(|e| e.to_string())
}

fn main() -> ExitCode {
    let filter = tracing_subscriber::EnvFilter::try_from_env("NVMEOF_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(nvmeof_bench::run::stderr_color())
        .with_target(false)
        .init();
    let args = Args::parse();
    match real_main(args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::from(1),
        Err(e) => {
            eprintln!("nvmeof-bench: {}", one_line(&e));
            ExitCode::from(2)
        }
    }
}

/// An error and its causes on one line, each cause once (a cause whose text the message
/// already carries is not repeated).
fn one_line(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        let text = text.split_whitespace().collect::<Vec<_>>().join(" ");
        if out.contains(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}

fn real_main(args: Args) -> anyhow::Result<bool> {
    if args.print_quick_job {
        print!("{QUICK_JOB}");
        return Ok(true);
    }
    let (mut file, job_file) = if args.quick {
        (
            JobFile::parse(QUICK_JOB)?,
            Some("(built-in --quick)".to_string()),
        )
    } else {
        let path = args.job.clone().context("a job file is required")?;
        (JobFile::load(&path)?, Some(path.display().to_string()))
    };
    if let Some(names) = &args.jobs {
        file.keep_jobs(names)?;
    }
    let ov = Overrides {
        modes: args.modes.clone(),
        runtime: args.runtime,
        ramp_time: args.ramp_time,
        repeat: args.repeat,
        verify: args.no_verify.then_some(false),
        prefill: if args.prefill {
            Some(true)
        } else {
            args.no_prefill.then_some(false)
        },
        hostnqn: args.hostnqn.clone(),
        backend: args.backend.clone(),
        target_reactors: args.target_reactors,
        target_poll_us: args.target_poll_us,
        client_poll_us: args.client_poll_us,
        sq_flow_control: args.sq_flow_control,
        target_cpus: args.target_cpus.clone(),
        client_cpus: args.client_cpus.clone(),
        nqn: args.nqn.clone(),
        iqn: args.iqn.clone(),
        lun: args.lun,
        target_bin: args.target_bin.clone(),
        target_addr: args.target.clone(),
        host_load: args.busy.then_some(HostLoad::Busy),
        load_threads: args.load_threads,
        size: args.size,
        target_pid: args.target_pid,
    };
    let mut plan = Plan::resolve(&file, &ov)?;
    for skipped in &plan.skipped {
        eprintln!("nvmeof-bench: skipped {skipped}");
    }
    if plan.target_pid.is_some() && plan.modes.iter().all(Mode::owns_target) {
        bail!(
            "--target-pid names the process of a target given by address (--target, \
             tcp=HOST:PORT, rdma=HOST:PORT or iscsi=HOST:PORT); no mode of this run has one"
        );
    }
    if plan.hostnqn.is_none()
        && plan
            .modes
            .iter()
            .any(|m| !m.owns_target() && !matches!(m, Mode::Iscsi { .. }))
    {
        let state_dir = args
            .state_dir
            .clone()
            .unwrap_or_else(nvmeof_initiator::default_state_dir);
        plan.host = Some(HostChoice::system(&state_dir)?);
    }
    for mode in plan.modes.iter().filter(|m| !m.owns_target()) {
        // Somebody else's target: say once whether it is written to and what is verified.
        if plan.points.iter().any(|p| p.writes() || p.prefill_in(mode)) {
            eprintln!(
                "nvmeof-bench: note: this job writes to the target {mode} (write jobs or prefill)"
            );
        }
        if plan
            .points
            .iter()
            .any(|p| p.reads() && p.verify && !p.prefill_in(mode))
        {
            eprintln!(
                "nvmeof-bench: note: reads of {mode} are checked against the pattern only after \
                 a prefill (--prefill); without one they are not verified"
            );
        }
    }
    let command = std::env::args().collect::<Vec<_>>().join(" ");
    let report = run(
        &plan,
        &RunOptions {
            command,
            job_file,
            progress: !args.quiet,
        },
    )?;
    let md = report.to_markdown();
    println!("{md}");
    if let Some(p) = &args.json {
        std::fs::write(p, report.to_json())
            .with_context(|| format!("cannot write {}", p.display()))?;
    }
    if let Some(p) = &args.markdown {
        std::fs::write(p, &md).with_context(|| format!("cannot write {}", p.display()))?;
    }
    if let Some(dir) = &args.svg {
        let paths = svg::write_plots(&report, dir)
            .with_context(|| format!("cannot write plots into {}", dir.display()))?;
        if !args.quiet {
            for p in paths {
                eprintln!("wrote {}", p.display());
            }
        }
    }
    if !report.all_ok() {
        if report
            .points
            .iter()
            .flat_map(|p| &p.results)
            .any(|r| r.summary.verify_errors > 0)
        {
            bail!("verify errors: reads returned data that was not written");
        }
        eprintln!("nvmeof-bench: some measurements failed (see the table)");
        return Ok(false);
    }
    Ok(true)
}
