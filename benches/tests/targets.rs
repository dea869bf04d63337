//! `targets = N`: several in-process targets standing in for several drives, one controller
//! each, every namespace of every target read and verified.

use nvmeof_bench::job::{JobFile, Mode, Overrides, Plan, TcpTarget};
use nvmeof_bench::run::{RunOptions, run};

const JOB: &str = r#"
[global]
backend = "mem:16M"
namespaces = 2
target_reactors = 2
size = "4M"
runtime = "500ms"
ramp_time = "100ms"
verify = true

[[job]]
name = "rand"
rw = "randread"
bs = "4k"
iodepth = 4
numjobs = 2
queue_pairs = 2
targets = [2, 1]

[[job]]
name = "mix"
rw = "randrw"
rwmixread = 70
bs = "8k"
iodepth = 4
targets = 2

[[job]]
name = "one-ns-rtc"
namespaces = 1
rw = "randread"
bs = "4k"
iodepth = 4
numjobs = 2
api = "rtc"
targets = 2
"#;

#[test]
fn two_in_process_targets_serve_every_namespace() {
    let plan = Plan::resolve(
        &JobFile::parse(JOB).unwrap(),
        &Overrides {
            modes: Some(vec![Mode::Tcp(TcpTarget::InProcess)]),
            ..Default::default()
        },
    )
    .unwrap();
    let targets: Vec<u32> = plan.points.iter().map(|p| p.targets).collect();
    assert_eq!(targets, [2, 1, 2, 2]);
    let r = run(
        &plan,
        &RunOptions {
            command: "test".into(),
            job_file: None,
            progress: false,
        },
    )
    .unwrap();
    assert!(r.all_ok(), "{}", r.to_markdown());
    for p in &r.points {
        let m = &p.results[0].repeats[0];
        let n = p.point.targets;
        assert!(m.ok, "{}: {m:?}", p.label);
        assert!(m.verified_reads > 0, "{}: reads were not verified", p.label);
        assert_eq!(m.verify_errors, 0);
        let queue_pairs = if p.job == "rand" { 2 } else { 1 };
        assert_eq!(m.queues, Some(queue_pairs), "queue pairs per controller");
        // Namespaces target by target: (0, 1), (0, 2), (1, 1), (1, 2), each read (the last
        // job reads the first namespace of each target only).
        let ids: Vec<(u32, u32)> = m.namespaces.iter().map(|s| (s.target, s.nsid)).collect();
        let k = p.point.namespaces;
        let want: Vec<(u32, u32)> = (0..n).flat_map(|t| (1..=k).map(move |i| (t, i))).collect();
        assert_eq!(ids, want, "{}", p.label);
        assert!(m.namespaces.iter().all(|s| s.ops > 0), "{}: {m:?}", p.label);
        assert_eq!(m.namespaces.iter().map(|s| s.ops).sum::<u64>(), m.all.ops);
        let per_target: Vec<u64> = (0..n)
            .map(|t| {
                m.namespaces
                    .iter()
                    .filter(|s| s.target == t)
                    .map(|s| s.ops)
                    .sum()
            })
            .collect();
        assert!(per_target.iter().all(|&o| o > 0), "{per_target:?}");
        assert!(m.ns_spread.is_some());
        assert_eq!(m.namespaces.len(), (n * k) as usize);
        let t = m
            .cpu
            .target_cpu_s
            .expect("in-process target CPU is measured");
        assert!(
            t > 0.0,
            "{}: the targets did work but used no CPU?",
            p.label
        );
        if p.job == "mix" {
            assert!(m.read.ops > 0 && m.write.ops > 0, "{m:?}");
        }
    }
    assert_eq!(r.points[0].label, "randread 4k qd4 x2 qp2 2tgt");
    assert_eq!(r.points[1].label, "randread 4k qd4 x2 qp2 1tgt");
    let v: serde_json::Value = serde_json::from_str(&r.to_json()).unwrap();
    assert_eq!(v["points"][0]["point"]["targets"], 2);
    assert_eq!(v["points"][0]["point"]["sweep"][0], "targets");
    let ns = &v["points"][0]["results"][0]["repeats"][0]["namespaces"];
    assert_eq!(ns[3]["target"], 1);
    assert_eq!(ns[3]["nsid"], 2);
}
