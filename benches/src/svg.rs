//! SVG plots written by hand (no plotting dependency): line charts for latency against load
//! and for scaling curves, grouped bars for DAS against the fabric modes.
//!
//! [`write_plots`] writes, for a report:
//! - `das-vs-of.svg`: IOPS of every point in every mode, grouped by point, with the
//!   fabric/DAS ratio above each fabric bar;
//! - `<job>-latency.svg` for every job with more than one point: median and p99 latency
//!   against achieved IOPS, one curve per mode (the latency-vs-load curve);
//! - `<job>-scaling.svg` for every job sweeping `numjobs`, `queue_pairs`, `targets`, `iodepth`
//!   or `bs`: IOPS against the swept value, one curve per mode.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

use crate::report::{Report, fmt_si};

const W: f64 = 760.0;
const H: f64 = 440.0;
const LEFT: f64 = 80.0;
const RIGHT: f64 = 170.0;
const TOP: f64 = 50.0;
const BOTTOM: f64 = 70.0;
const COLORS: [&str; 8] = [
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
];

/// Escapes text for XML.
pub fn xml_escape(s: &str) -> String {
    let mut o = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => o.push_str("&amp;"),
            '<' => o.push_str("&lt;"),
            '>' => o.push_str("&gt;"),
            '"' => o.push_str("&quot;"),
            '\'' => o.push_str("&apos;"),
            c if (c as u32) < 0x20 && c != '\n' && c != '\t' => o.push(' '),
            c => o.push(c),
        }
    }
    o
}

/// One curve.
#[derive(Debug, Clone)]
pub struct Series {
    /// Legend text.
    pub name: String,
    /// Points `(x, y)`, drawn in order.
    pub points: Vec<(f64, f64)>,
    /// A short label drawn next to each point (e.g. its queue depth); empty: none.
    pub labels: Vec<String>,
    /// Dashed line.
    pub dashed: bool,
    /// Color index.
    pub color: usize,
}

/// A line chart.
#[derive(Debug, Clone)]
pub struct LineChart {
    /// Title.
    pub title: String,
    /// X axis label.
    pub x_label: String,
    /// Y axis label.
    pub y_label: String,
    /// Logarithmic x axis (base 2 ticks).
    pub log_x: bool,
    /// Logarithmic y axis (1-2-5 ticks per decade).
    pub log_y: bool,
    /// Curves.
    pub series: Vec<Series>,
}

/// Round tick values covering `0..=max`.
fn nice_ticks(max: f64) -> Vec<f64> {
    if !(max.is_finite() && max > 0.0) {
        return vec![0.0, 1.0];
    }
    let raw = max / 5.0;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 2.5, 5.0, 10.0]
        .iter()
        .map(|m| m * mag)
        .find(|s| *s >= raw)
        .unwrap_or(10.0 * mag);
    let n = (max / step).ceil() as usize;
    (0..=n).map(|i| i as f64 * step).collect()
}

/// A y axis: round ticks from 0 (linear) or 1-2-5 ticks over whole decades (logarithmic).
struct YAxis {
    log: bool,
    ticks: Vec<f64>,
    lo: f64,
    hi: f64,
}

impl YAxis {
    fn new(values: impl Iterator<Item = f64>, log: bool) -> Self {
        let v: Vec<f64> = values.filter(|x| x.is_finite()).collect();
        let max = v.iter().copied().fold(0.0, f64::max);
        let min_pos = v
            .iter()
            .copied()
            .filter(|x| *x > 0.0)
            .fold(f64::INFINITY, f64::min);
        if log && max > 0.0 && min_pos.is_finite() {
            let a = min_pos.log10().floor() as i32;
            let b = (max.log10().ceil() as i32).max(a + 1);
            let steps: &[f64] = if b - a > 3 { &[1.0] } else { &[1.0, 2.0, 5.0] };
            let mut ticks = Vec::new();
            for e in a..=b {
                for m in steps {
                    let t = m * 10f64.powi(e);
                    if t <= 10f64.powi(b) {
                        ticks.push(t);
                    }
                }
            }
            YAxis {
                log: true,
                ticks,
                lo: 10f64.powi(a),
                hi: 10f64.powi(b),
            }
        } else {
            let ticks = nice_ticks(max);
            let hi = *ticks.last().unwrap_or(&1.0);
            YAxis {
                log: false,
                ticks,
                lo: 0.0,
                hi,
            }
        }
    }

    /// The picture's y coordinate of value `y`.
    fn py(&self, y: f64) -> f64 {
        let f = if self.log {
            (y.max(self.lo).log10() - self.lo.log10()) / (self.hi.log10() - self.lo.log10())
        } else {
            y / self.hi.max(1e-12)
        };
        H - BOTTOM - f * (H - BOTTOM - TOP)
    }

    /// The tick lines and labels.
    fn draw(&self, s: &mut String) {
        for &t in &self.ticks {
            let y = self.py(t);
            let _ = writeln!(
                s,
                r##"<line x1="{LEFT}" y1="{y:.1}" x2="{}" y2="{y:.1}" stroke="#ddd"/><text x="{}" y="{:.1}" text-anchor="end">{}</text>"##,
                W - RIGHT,
                LEFT - 6.0,
                y + 4.0,
                tick_label(t)
            );
        }
    }
}

/// Whether values spanning this much are better drawn on a logarithmic axis.
fn wide(values: impl Iterator<Item = f64>) -> bool {
    let (lo, hi) = values
        .filter(|v| v.is_finite() && *v > 0.0)
        .fold((f64::INFINITY, 0.0f64), |(a, b), v| (a.min(v), b.max(v)));
    lo.is_finite() && hi / lo > 20.0
}

fn tick_label(v: f64) -> String {
    if v == 0.0 {
        "0".into()
    } else if v.abs() >= 1000.0 {
        fmt_si(v)
    } else if v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        format!("{v:.2}")
    }
}

fn header(s: &mut String, title: &str) {
    let _ = writeln!(
        s,
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{W}" height="{H}" viewBox="0 0 {W} {H}" font-family="sans-serif" font-size="12">"#
    );
    let _ = writeln!(s, r#"<rect width="{W}" height="{H}" fill="white"/>"#);
    let _ = writeln!(
        s,
        r#"<text x="{}" y="24" text-anchor="middle" font-size="15" font-weight="bold">{}</text>"#,
        (LEFT + W - RIGHT) / 2.0,
        xml_escape(title)
    );
}

fn axes(s: &mut String, x_label: &str, y_label: &str) {
    let (x0, y0, x1, y1) = (LEFT, H - BOTTOM, W - RIGHT, TOP);
    let _ = writeln!(
        s,
        r#"<path d="M{x0} {y1} L{x0} {y0} L{x1} {y0}" fill="none" stroke="black"/>"#
    );
    let _ = writeln!(
        s,
        r#"<text x="{}" y="{}" text-anchor="middle">{}</text>"#,
        (x0 + x1) / 2.0,
        H - 25.0,
        xml_escape(x_label)
    );
    let _ = writeln!(
        s,
        r#"<text x="18" y="{}" text-anchor="middle" transform="rotate(-90 18 {})">{}</text>"#,
        (y0 + y1) / 2.0,
        (y0 + y1) / 2.0,
        xml_escape(y_label)
    );
}

/// Width of a legend entry's text: from after its line sample to the right edge.
const LEGEND_TEXT_W: f64 = RIGHT - 15.0 - 28.0 - 4.0;
const _: () = assert!(W - RIGHT + 43.0 + LEGEND_TEXT_W <= W);
/// Estimated width of a character of the 12 px sans-serif font.
const CHAR_W: f64 = 6.8;

fn legend(s: &mut String, entries: &[(String, usize, bool)]) {
    let x = W - RIGHT + 15.0;
    for (i, (name, color, dashed)) in entries.iter().enumerate() {
        let y = TOP + 10.0 + i as f64 * 20.0;
        let _ = writeln!(
            s,
            r#"<line x1="{x}" y1="{y}" x2="{}" y2="{y}" stroke="{}" stroke-width="3"{}/>"#,
            x + 22.0,
            COLORS[color % COLORS.len()],
            if *dashed {
                r#" stroke-dasharray="6 3""#
            } else {
                ""
            }
        );
        // A long name (a mode with an address) is squeezed to fit instead of running off the
        // picture, where it would lose its end.
        let fit = if name.chars().count() as f64 * CHAR_W > LEGEND_TEXT_W {
            format!(r#" textLength="{LEGEND_TEXT_W}" lengthAdjust="spacingAndGlyphs""#)
        } else {
            String::new()
        };
        let _ = writeln!(
            s,
            r#"<text x="{}" y="{}"{fit}>{}</text>"#,
            x + 28.0,
            y + 4.0,
            xml_escape(name)
        );
    }
}

impl LineChart {
    /// The SVG document.
    pub fn render(&self) -> String {
        let mut s = String::new();
        header(&mut s, &self.title);
        axes(&mut s, &self.x_label, &self.y_label);
        let pts = || self.series.iter().flat_map(|se| se.points.iter());
        let tx = |x: f64| if self.log_x { x.max(1e-9).log2() } else { x };
        let xmin = if self.log_x {
            pts().map(|p| tx(p.0)).fold(f64::INFINITY, f64::min)
        } else {
            0.0
        };
        let xmax = pts().map(|p| tx(p.0)).fold(f64::NEG_INFINITY, f64::max);
        let yaxis = YAxis::new(pts().map(|p| p.1), self.log_y);
        let (xmin, xmax) = if !(xmin.is_finite() && xmax.is_finite()) {
            (0.0, 1.0)
        } else if xmax <= xmin {
            (xmin - 1.0, xmax + 1.0)
        } else {
            (xmin, xmax)
        };
        let (xticks, xspan_max): (Vec<f64>, f64) = if self.log_x {
            let a = xmin.floor() as i64;
            let b = xmax.ceil() as i64;
            ((a..=b).map(|e| e as f64).collect(), b as f64)
        } else {
            let t = nice_ticks(xmax);
            let top = *t.last().unwrap_or(&1.0);
            (t, top)
        };
        let xspan_min = if self.log_x { xmin.floor() } else { 0.0 };
        let px = |x: f64| {
            LEFT + (tx(x) - xspan_min) / (xspan_max - xspan_min).max(1e-12) * (W - RIGHT - LEFT)
        };
        let py = |y: f64| yaxis.py(y);
        yaxis.draw(&mut s);
        for &t in &xticks {
            let v = if self.log_x { t.exp2() } else { t };
            let x = px(v);
            let _ = writeln!(
                s,
                r##"<line x1="{x:.1}" y1="{}" x2="{x:.1}" y2="{}" stroke="#999"/><text x="{x:.1}" y="{}" text-anchor="middle">{}</text>"##,
                H - BOTTOM,
                H - BOTTOM + 5.0,
                H - BOTTOM + 18.0,
                tick_label(v)
            );
        }
        for se in &self.series {
            if se.points.is_empty() {
                continue;
            }
            let color = COLORS[se.color % COLORS.len()];
            let mut d = String::new();
            for (i, &(x, y)) in se.points.iter().enumerate() {
                let _ = write!(
                    d,
                    "{}{:.1} {:.1}",
                    if i == 0 { "M" } else { " L" },
                    px(x),
                    py(y)
                );
            }
            let _ = writeln!(
                s,
                r#"<path d="{d}" fill="none" stroke="{color}" stroke-width="2"{}/>"#,
                if se.dashed {
                    r#" stroke-dasharray="6 3""#
                } else {
                    ""
                }
            );
            for (i, &(x, y)) in se.points.iter().enumerate() {
                let _ = writeln!(
                    s,
                    r#"<circle cx="{:.1}" cy="{:.1}" r="3" fill="{color}"><title>{}: {} , {}</title></circle>"#,
                    px(x),
                    py(y),
                    xml_escape(&se.name),
                    tick_label(x),
                    tick_label(y)
                );
                if let Some(l) = se.labels.get(i) {
                    let _ = writeln!(
                        s,
                        r#"<text x="{:.1}" y="{:.1}" font-size="10" fill="{color}">{}</text>"#,
                        px(x) + 5.0,
                        py(y) - 5.0,
                        xml_escape(l)
                    );
                }
            }
        }
        let entries: Vec<(String, usize, bool)> = self
            .series
            .iter()
            .map(|se| (se.name.clone(), se.color, se.dashed))
            .collect();
        legend(&mut s, &entries);
        s.push_str("</svg>\n");
        s
    }
}

/// One bar: its value (`None`: no bar) and a note drawn above it.
pub type Bar = (Option<f64>, Option<String>);

/// A grouped bar chart.
#[derive(Debug, Clone)]
pub struct BarChart {
    /// Title.
    pub title: String,
    /// X axis label (what the groups are).
    pub x_label: String,
    /// Y axis label.
    pub y_label: String,
    /// Logarithmic y axis (1-2-5 ticks per decade).
    pub log_y: bool,
    /// Series names (one bar per series in each group).
    pub series: Vec<String>,
    /// Groups: a label and one value per series (`None`: no bar), plus an optional note per
    /// bar drawn above it.
    pub groups: Vec<(String, Vec<Bar>)>,
}

impl BarChart {
    /// The SVG document.
    pub fn render(&self) -> String {
        let mut s = String::new();
        header(&mut s, &self.title);
        axes(&mut s, &self.x_label, &self.y_label);
        let yaxis = YAxis::new(
            self.groups
                .iter()
                .flat_map(|g| g.1.iter().filter_map(|b| b.0)),
            self.log_y,
        );
        let py = |y: f64| yaxis.py(y);
        yaxis.draw(&mut s);
        let n = self.groups.len().max(1) as f64;
        let gw = (W - RIGHT - LEFT) / n;
        let nb = self.series.len().max(1) as f64;
        let bw = gw * 0.8 / nb;
        for (gi, (label, bars)) in self.groups.iter().enumerate() {
            let gx = LEFT + gi as f64 * gw + gw * 0.1;
            for (bi, (v, note)) in bars.iter().enumerate() {
                let Some(v) = v else { continue };
                let x = gx + bi as f64 * bw;
                let y = py(*v);
                let _ = writeln!(
                    s,
                    r#"<rect x="{x:.1}" y="{y:.1}" width="{:.1}" height="{:.1}" fill="{}"><title>{}: {}</title></rect>"#,
                    (bw - 2.0).max(1.0),
                    (H - BOTTOM - y).max(0.0),
                    COLORS[bi % COLORS.len()],
                    xml_escape(self.series.get(bi).map_or("", String::as_str)),
                    tick_label(*v)
                );
                if let Some(n) = note {
                    let _ = writeln!(
                        s,
                        r#"<text x="{:.1}" y="{:.1}" text-anchor="middle" font-size="10">{}</text>"#,
                        x + bw / 2.0,
                        y - 4.0,
                        xml_escape(n)
                    );
                }
            }
            let cx = LEFT + gi as f64 * gw + gw / 2.0;
            let _ = writeln!(
                s,
                r#"<text x="{cx:.1}" y="{}" text-anchor="end" font-size="10" transform="rotate(-25 {cx:.1} {})">{}</text>"#,
                H - BOTTOM + 14.0,
                H - BOTTOM + 14.0,
                xml_escape(label)
            );
        }
        let entries: Vec<(String, usize, bool)> = self
            .series
            .iter()
            .enumerate()
            .map(|(i, n)| (n.clone(), i, false))
            .collect();
        legend(&mut s, &entries);
        s.push_str("</svg>\n");
        s
    }
}

/// The load of a point on a latency curve: `qd32`, with ` x4` for several workers.
fn load_label(p: &crate::job::Point) -> String {
    if p.numjobs > 1 {
        format!("qd{} x{}", p.iodepth, p.numjobs)
    } else {
        format!("qd{}", p.iodepth)
    }
}

fn file_name(job: &str, suffix: &str) -> String {
    let clean: String = job
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                c
            } else {
                '_'
            }
        })
        .collect();
    format!("{clean}-{suffix}.svg")
}

/// The plots of a report, as `(file name, SVG text)`.
pub fn plots(r: &Report) -> Vec<(String, String)> {
    let mut out = Vec::new();
    let modes = &r.plan.modes;
    // DAS vs oF bars.
    let groups: Vec<(String, Vec<Bar>)> = r
        .points
        .iter()
        .map(|p| {
            let bars = modes
                .iter()
                .map(|m| {
                    let res = p.results.iter().find(|x| &x.mode == m);
                    let v = res.and_then(|x| x.summary.iops).map(|st| st.median);
                    let note = res
                        .and_then(|x| x.vs_das)
                        .map(|v| format!("{:.2}x", v.iops_ratio));
                    (v, note)
                })
                .collect();
            (p.label.clone(), bars)
        })
        .collect();
    out.push((
        "das-vs-of.svg".to_string(),
        BarChart {
            title: "IOPS by mode (ratio to DAS above the bars)".into(),
            x_label: "point (pattern, block size, queue depth, workers)".into(),
            y_label: "IOPS".into(),
            // 4 KiB and 128 KiB points side by side differ by more than an order of magnitude.
            log_y: wide(
                groups
                    .iter()
                    .flat_map(|g: &(String, Vec<Bar>)| g.1.iter().filter_map(|b| b.0)),
            ),
            series: modes.clone(),
            groups,
        }
        .render(),
    ));
    // Per job: latency vs load and scaling.
    let mut jobs: Vec<&str> = Vec::new();
    for p in &r.points {
        if !jobs.contains(&p.job.as_str()) {
            jobs.push(&p.job);
        }
    }
    for job in jobs {
        let pts: Vec<_> = r.points.iter().filter(|p| p.job == job).collect();
        if pts.len() < 2 {
            continue;
        }
        let mut lat = Vec::new();
        for (mi, m) in modes.iter().enumerate() {
            let mut p50 = Vec::new();
            let mut p99 = Vec::new();
            let mut labels = Vec::new();
            for p in &pts {
                if let Some(res) = p.results.iter().find(|x| &x.mode == m)
                    && let (Some(i), Some(a), Some(b)) = (
                        res.summary.iops,
                        res.summary.lat_p50_us,
                        res.summary.lat_p99_us,
                    )
                {
                    p50.push((i.median, a.median));
                    p99.push((i.median, b.median));
                    labels.push(load_label(&p.point));
                }
            }
            lat.push(Series {
                // The percentile first: it is what tells the two curves of a mode apart.
                name: format!("p50 {m}"),
                points: p50,
                labels,
                dashed: false,
                color: mi,
            });
            lat.push(Series {
                name: format!("p99 {m}"),
                points: p99,
                labels: Vec::new(),
                dashed: true,
                color: mi,
            });
        }
        out.push((
            file_name(job, "latency"),
            LineChart {
                title: format!("{job}: latency against load"),
                x_label: "IOPS (points labelled with their load: qd = queue depth, x = workers)"
                    .into(),
                y_label: "latency (µs, log scale)".into(),
                log_x: false,
                log_y: true,
                series: lat,
            }
            .render(),
        ));
        let sweep = &pts[0].point.sweep;
        let key = ["numjobs", "queue_pairs", "targets", "iodepth", "bs"]
            .into_iter()
            .find(|k| sweep.iter().any(|s| s == k));
        if let Some(key) = key {
            let xval = |p: &crate::report::PointReport| -> f64 {
                match key {
                    "numjobs" => f64::from(p.point.numjobs),
                    "queue_pairs" => f64::from(p.point.queue_pairs),
                    "targets" => f64::from(p.point.targets),
                    "iodepth" => f64::from(p.point.iodepth),
                    _ => p.point.bs as f64,
                }
            };
            let mut series = Vec::new();
            for (mi, m) in modes.iter().enumerate() {
                let mut v = Vec::new();
                for p in &pts {
                    if let Some(res) = p.results.iter().find(|x| &x.mode == m)
                        && let Some(i) = res.summary.iops
                    {
                        v.push((xval(p), i.median));
                    }
                }
                v.sort_by(|a, b| a.0.total_cmp(&b.0));
                series.push(Series {
                    name: m.clone(),
                    points: v,
                    labels: Vec::new(),
                    dashed: false,
                    color: mi,
                });
            }
            out.push((
                file_name(job, "scaling"),
                LineChart {
                    title: format!("{job}: IOPS against {key}"),
                    x_label: key.into(),
                    y_label: "IOPS".into(),
                    log_x: true,
                    log_y: false,
                    series,
                }
                .render(),
            ));
        }
    }
    out
}

/// Writes the plots of a report into `dir` (created if missing); returns the paths.
pub fn write_plots(r: &Report, dir: &Path) -> std::io::Result<Vec<PathBuf>> {
    std::fs::create_dir_all(dir)?;
    let mut paths = Vec::new();
    for (name, svg) in plots(r) {
        let p = dir.join(name);
        std::fs::write(&p, svg)?;
        paths.push(p);
    }
    Ok(paths)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A small XML well-formedness check: balanced, properly nested tags, quoted attributes,
    /// known entities only, one root element.
    fn well_formed(doc: &str) -> Result<(), String> {
        let mut stack: Vec<String> = Vec::new();
        let mut roots = 0;
        let mut rest = doc;
        while let Some(lt) = rest.find('<') {
            check_text(&rest[..lt])?;
            let after = &rest[lt + 1..];
            let gt = after.find('>').ok_or("unclosed tag")?;
            let tag = &after[..gt];
            rest = &after[gt + 1..];
            if let Some(name) = tag.strip_prefix('/') {
                let open = stack.pop().ok_or(format!("stray </{name}>"))?;
                if open != name.trim() {
                    return Err(format!("</{name}> closes <{open}>"));
                }
                continue;
            }
            let self_closing = tag.ends_with('/');
            let body = tag.trim_end_matches('/');
            let name: String = body.chars().take_while(|c| !c.is_whitespace()).collect();
            if name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric()) {
                return Err(format!("bad tag name in <{tag}>"));
            }
            let attrs = &body[name.len()..];
            if attrs.matches('"').count() % 2 != 0 {
                return Err(format!("unbalanced quotes in <{tag}>"));
            }
            check_text(attrs)?;
            if stack.is_empty() {
                roots += 1;
            }
            if !self_closing {
                stack.push(name);
            }
        }
        check_text(rest)?;
        if !stack.is_empty() {
            return Err(format!("unclosed {stack:?}"));
        }
        if roots != 1 {
            return Err(format!("{roots} root elements"));
        }
        Ok(())
    }

    fn check_text(t: &str) -> Result<(), String> {
        let mut rest = t;
        while let Some(amp) = rest.find('&') {
            let after = &rest[amp..];
            if !["&amp;", "&lt;", "&gt;", "&quot;", "&apos;"]
                .iter()
                .any(|e| after.starts_with(e))
            {
                return Err(format!(
                    "bad entity near {:?}",
                    &after[..after.len().min(8)]
                ));
            }
            rest = &rest[amp + 1..];
        }
        Ok(())
    }

    #[test]
    fn checker_rejects_broken_documents() {
        assert!(well_formed("<svg><g></svg>").is_err());
        assert!(well_formed("<svg>a & b</svg>").is_err());
        assert!(well_formed("<svg/><svg/>").is_err());
        assert!(well_formed(r#"<svg a="1><g/></svg>"#).is_err());
        assert!(well_formed("<svg><g/>&lt;</svg>").is_ok());
    }

    #[test]
    fn report_plots_are_well_formed_svg() {
        let r = crate::report::tests::sample_report();
        let plots = plots(&r);
        let names: Vec<&str> = plots.iter().map(|p| p.0.as_str()).collect();
        assert_eq!(
            names,
            vec!["das-vs-of.svg", "j-latency.svg", "j-scaling.svg"]
        );
        for (name, svg) in &plots {
            well_formed(svg).unwrap_or_else(|e| panic!("{name}: {e}\n{svg}"));
            assert!(svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
            assert!(!svg.contains("NaN") && !svg.contains("inf"), "{name}");
        }
        // Bars carry the ratio; curves carry one path per series.
        assert!(plots[0].1.contains("0.80x"));
        assert_eq!(plots[1].1.matches("stroke-width=\"2\"").count(), 4);
        assert!(plots[2].1.contains("IOPS against iodepth"));
        assert!(plots[1].1.contains(">p50 das</text>") && plots[1].1.contains(">p99 das</text>"));
        // The bars say what their groups are; latency is on a log axis, each point labelled
        // with its queue depth.
        assert!(
            plots[0].1.contains(">point (pattern, block size"),
            "{}",
            plots[0].1
        );
        assert!(plots[1].1.contains("log scale") && plots[1].1.contains(">qd32</text>"));
    }

    #[test]
    fn log_axes_span_whole_decades() {
        let y = YAxis::new([40.0, 3000.0].into_iter(), true);
        assert_eq!((y.lo, y.hi), (10.0, 10_000.0));
        assert!(y.ticks.contains(&20.0) && y.ticks.contains(&5000.0));
        assert!((y.py(100.0) - (H - BOTTOM - (H - BOTTOM - TOP) / 3.0)).abs() < 1e-9);
        // 4 KiB and 128 KiB IOPS side by side get a log axis; close values do not.
        assert!(wide([900_000.0, 30_000.0].into_iter()));
        assert!(!wide([900_000.0, 300_000.0].into_iter()));
    }

    #[test]
    fn long_legend_names_fit_and_keep_the_percentile() {
        let series = |name: &str, color| Series {
            name: name.into(),
            points: vec![(1.0, 2.0), (2.0, 3.0)],
            labels: Vec::new(),
            dashed: false,
            color,
        };
        let svg = LineChart {
            title: "t".into(),
            x_label: "x".into(),
            y_label: "y".into(),
            log_x: false,
            log_y: false,
            series: vec![
                series("p50 tcp@192.168.100.200:44200", 0),
                series("p99 tcp@192.168.100.200:44200", 0),
                series("p50 das", 1),
            ],
        }
        .render();
        well_formed(&svg).unwrap();
        let texts: Vec<&str> = svg
            .lines()
            .filter(|l| l.contains(&format!("x=\"{}\"", W - RIGHT + 43.0)))
            .collect();
        assert_eq!(texts.len(), 3, "{svg}");
        assert!(texts[0].contains("textLength") && texts[0].contains(">p50 tcp@"));
        assert!(texts[1].contains("textLength") && texts[1].contains(">p99 tcp@"));
        assert!(!texts[2].contains("textLength"));
    }

    #[test]
    fn escaping_and_degenerate_charts() {
        assert_eq!(xml_escape("a<b & \"c\""), "a&lt;b &amp; &quot;c&quot;");
        let empty = LineChart {
            title: "t <1>".into(),
            x_label: "x".into(),
            y_label: "y".into(),
            log_x: true,
            log_y: true,
            series: vec![Series {
                name: "s".into(),
                points: vec![],
                labels: Vec::new(),
                dashed: false,
                color: 0,
            }],
        }
        .render();
        well_formed(&empty).unwrap();
        assert!(!empty.contains("NaN"));
        let one = LineChart {
            title: "one".into(),
            x_label: "x".into(),
            y_label: "y".into(),
            log_x: false,
            log_y: true,
            series: vec![Series {
                name: "s".into(),
                points: vec![(5.0, 0.0)],
                labels: vec!["qd1".into()],
                dashed: false,
                color: 9,
            }],
        }
        .render();
        well_formed(&one).unwrap();
        assert!(!one.contains("NaN"));
        let bars = BarChart {
            title: "b".into(),
            x_label: "x".into(),
            y_label: "y".into(),
            log_y: true,
            series: vec!["a".into()],
            groups: vec![("g".into(), vec![(None, None)])],
        }
        .render();
        well_formed(&bars).unwrap();
    }

    #[test]
    fn ticks_are_round() {
        assert_eq!(nice_ticks(10.0), vec![0.0, 2.0, 4.0, 6.0, 8.0, 10.0]);
        assert_eq!(nice_ticks(0.0), vec![0.0, 1.0]);
        let t = nice_ticks(412_345.0);
        assert!(*t.last().unwrap() >= 412_345.0 && t.len() <= 7, "{t:?}");
    }
}
