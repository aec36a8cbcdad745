//! SVG plots of a bench suite's results (plotters, SVG backend only: its
//! default features pull system fontconfig; SVG leaves text to the viewer).

use std::path::Path;

use anyhow::{Result, anyhow};
use plotters::prelude::*;
use serde_json::Value;

use crate::bench::Job;

/// Where a chart's legend goes (where its lines are not).
type Legend = SeriesLabelPosition;

/// One line of a chart.
#[derive(Debug, Clone)]
struct Line {
    label: String,
    color: usize,
    dashed: bool,
    markers: bool,
    points: Vec<(f64, f64)>,
}

const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(214, 39, 40),
    RGBColor(44, 160, 44),
    RGBColor(148, 103, 189),
    RGBColor(255, 127, 14),
    RGBColor(23, 190, 207),
];

fn f(v: &Value) -> Option<f64> {
    v.as_f64()
}

/// Log-axis bounds around every point, padded a little.
fn bounds(lines: &[Line], pick: fn(&(f64, f64)) -> f64) -> (f64, f64) {
    let vals = lines
        .iter()
        .flat_map(|l| l.points.iter().map(pick))
        .filter(|v| v.is_finite() && *v > 0.0);
    let (lo, hi) = vals.fold((f64::INFINITY, 0.0f64), |(lo, hi), v| {
        (lo.min(v), hi.max(v))
    });
    if lo.is_finite() && hi > 0.0 {
        (lo / 1.5, hi * 1.5)
    } else {
        (1.0, 10.0)
    }
}

/// Sizes as legends show them (binary: 4k is 4096 bytes).
fn human_bytes(v: f64) -> String {
    if v >= f64::from(1u32 << 20) {
        format!("{:.0}M", v / f64::from(1u32 << 20))
    } else if v >= 1024.0 {
        format!("{:.0}k", v / 1024.0)
    } else {
        format!("{v:.0}")
    }
}

/// Tick labels of a decimal log axis: 10, 100, 1000, 10^4 ...
fn tick(v: f64) -> String {
    if v >= 1e4 {
        format!(
            "{:.0}e{}",
            v / 10f64.powf(v.log10().floor()),
            v.log10().floor()
        )
    } else if v >= 10.0 {
        format!("{v:.0}")
    } else if v >= 1.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.3}")
    }
}

/// Draws `lines` on a log y axis, with a log x axis (sizes) or a linear
/// one (rank counts).
fn chart<DB: DrawingBackend>(
    area: &DrawingArea<DB, plotters::coord::Shift>,
    title: &str,
    x_desc: &str,
    y_desc: &str,
    x_log: bool,
    legend: Legend,
    lines: &[Line],
) -> Result<()> {
    let err = |e: String| anyhow!("plotting {title}: {e}");
    let (x0, x1) = bounds(lines, |p| p.0);
    let (y0, y1) = bounds(lines, |p| p.1);
    let mut builder = ChartBuilder::on(area);
    builder
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60);
    if x_log {
        let mut ch = builder
            .build_cartesian_2d((x0..x1).log_scale(), (y0..y1).log_scale())
            .map_err(|e| err(e.to_string()))?;
        ch.configure_mesh()
            .x_desc(x_desc)
            .y_desc(y_desc)
            .x_label_formatter(&|v| tick(*v))
            .y_label_formatter(&|v| tick(*v))
            .draw()
            .map_err(|e| err(e.to_string()))?;
        draw_lines(&mut ch, lines, legend).map_err(err)
    } else {
        let (x0, x1) = (x0 * 1.5 - 0.5, x1 / 1.5 + 0.5);
        let mut ch = builder
            .build_cartesian_2d(x0..x1, (y0..y1).log_scale())
            .map_err(|e| err(e.to_string()))?;
        ch.configure_mesh()
            .x_desc(x_desc)
            .y_desc(y_desc)
            .x_label_formatter(&|v| format!("{v:.0}"))
            .y_label_formatter(&|v| tick(*v))
            .draw()
            .map_err(|e| err(e.to_string()))?;
        draw_lines(&mut ch, lines, legend).map_err(err)
    }
}

/// Draws the lines and their legend on a chart of any x axis.
fn draw_lines<'a, DB, X>(
    ch: &mut ChartContext<'a, DB, Cartesian2d<X, LogCoord<f64>>>,
    lines: &[Line],
    legend: Legend,
) -> std::result::Result<(), String>
where
    DB: DrawingBackend + 'a,
    X: Ranged<ValueType = f64>,
{
    for l in lines {
        let color = COLORS[l.color % COLORS.len()];
        let style = color.stroke_width(2);
        let legend = move |(x, y): (i32, i32)| PathElement::new(vec![(x, y), (x + 20, y)], style);
        if l.dashed {
            ch.draw_series(DashedLineSeries::new(l.points.clone(), 6, 4, style))
                .map_err(|e| e.to_string())?
                .label(l.label.clone())
                .legend(legend);
        } else {
            ch.draw_series(
                LineSeries::new(l.points.clone(), style).point_size(if l.markers { 3 } else { 0 }),
            )
            .map_err(|e| e.to_string())?
            .label(l.label.clone())
            .legend(legend);
        }
    }
    ch.configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .position(legend)
        .draw()
        .map_err(|e| e.to_string())
}

fn write_svg(
    path: &Path,
    size: (u32, u32),
    draw: impl FnOnce(&DrawingArea<SVGBackend<'_>, plotters::coord::Shift>) -> Result<()>,
) -> Result<()> {
    let root = SVGBackend::new(path, size).into_drawing_area();
    root.fill(&WHITE).map_err(|e| anyhow!("{e}"))?;
    draw(&root)?;
    root.present()
        .map_err(|e| anyhow!("writing {}: {e}", path.display()))
}

/// Ping-pong half round trips versus size, one line per path, floors dashed.
fn latency_lines(reports: &[(Job, Value)]) -> Vec<Line> {
    let mut lines = Vec::new();
    let mut floors: Vec<String> = Vec::new();
    for (i, (job, v)) in reports
        .iter()
        .filter(|r| r.0.bench == "pingpong")
        .enumerate()
    {
        let sizes = v["results"]["sizes"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let pts = |key: &str| -> Vec<(f64, f64)> {
            sizes
                .iter()
                .filter_map(|s| Some((f(&s["bytes"])?, f(&s["row"][key]["median"])?)))
                .collect()
        };
        lines.push(Line {
            label: job.path_label.clone(),
            color: i,
            dashed: false,
            markers: true,
            points: pts("us"),
        });
        let floor = v["results"]["floor"].as_str().unwrap_or("floor").to_owned();
        if !floors.contains(&floor) {
            lines.push(Line {
                label: format!("floor: {floor}"),
                color: i,
                dashed: true,
                markers: false,
                points: pts("floor_us"),
            });
            floors.push(floor);
        }
    }
    lines
}

/// One-way bandwidth versus size at the largest window, one line per path.
fn bandwidth_lines(reports: &[(Job, Value)]) -> Vec<Line> {
    let mut lines = Vec::new();
    let mut floors: Vec<String> = Vec::new();
    for (i, (job, v)) in reports
        .iter()
        .filter(|r| r.0.bench == "bandwidth")
        .enumerate()
    {
        let points = v["results"]["points"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let uni: Vec<&Value> = points
            .iter()
            .filter(|p| p["bidir"] == Value::Bool(false))
            .collect();
        let Some(window) = uni.iter().filter_map(|p| p["window"].as_u64()).max() else {
            continue;
        };
        let at = |p: &&&Value| p["window"].as_u64() == Some(window);
        let gbps =
            |p: &Value, key: &str| Some(f(&p["bytes"])? / (f(&p["row"][key]["median"])? * 1e3));
        lines.push(Line {
            label: format!("{} (window {window})", job.path_label),
            color: i,
            dashed: false,
            markers: true,
            points: uni
                .iter()
                .filter(at)
                .filter_map(|p| Some((f(&p["bytes"])?, gbps(p, "us")?)))
                .collect(),
        });
        let floor = v["results"]["floor"].as_str().unwrap_or("floor").to_owned();
        if !floors.contains(&floor) {
            lines.push(Line {
                label: format!("floor: {floor}"),
                color: i,
                dashed: true,
                markers: false,
                points: uni
                    .iter()
                    .filter(at)
                    .filter_map(|p| Some((f(&p["bytes"])?, gbps(p, "floor_us")?)))
                    .collect(),
            });
            floors.push(floor);
        }
    }
    lines
}

/// Per loggp report: measured (solid) and predicted (dashed) all-to-all
/// time versus ranks, one colour per size.
fn loggp_panels(reports: &[(Job, Value)]) -> Vec<(String, Vec<Line>)> {
    let mut panels = Vec::new();
    for (job, v) in reports.iter().filter(|r| r.0.bench == "loggp") {
        let preds = v["results"]["predictions"]
            .as_array()
            .cloned()
            .unwrap_or_default();
        let mut sizes: Vec<u64> = preds.iter().filter_map(|p| p["bytes"].as_u64()).collect();
        sizes.sort_unstable();
        sizes.dedup();
        let mut lines = Vec::new();
        for (c, &n) in sizes.iter().enumerate() {
            let of = |key: &dyn Fn(&Value) -> Option<f64>| -> Vec<(f64, f64)> {
                preds
                    .iter()
                    .filter(|p| p["bytes"].as_u64() == Some(n))
                    .filter_map(|p| Some((f(&p["ranks"])?, key(p)?)))
                    .collect()
            };
            lines.push(Line {
                label: format!("{} measured", human_bytes(n as f64)),
                color: c,
                dashed: false,
                markers: true,
                points: of(&|p| f(&p["measured"]["median"])),
            });
            lines.push(Line {
                label: format!("{} LogGP", human_bytes(n as f64)),
                color: c,
                dashed: true,
                markers: false,
                points: of(&|p| f(&p["prediction"]["us"])),
            });
        }
        panels.push((job.path_label.clone(), lines));
    }
    panels
}

/// Writes every plot the reports allow; returns (file name, caption).
pub fn all(out: &Path, reports: &[(Job, Value)]) -> Result<Vec<(String, String)>> {
    let mut made = Vec::new();
    let lat = latency_lines(reports);
    if !lat.is_empty() {
        let caption = "put-with-signal ping-pong: half round trip versus size";
        write_svg(&out.join("latency.svg"), (900, 560), |a| {
            chart(
                a,
                caption,
                "message size (bytes)",
                "half round trip (µs)",
                true,
                Legend::UpperLeft,
                &lat,
            )
        })?;
        made.push(("latency.svg".to_owned(), caption.to_owned()));
    }
    let bw = bandwidth_lines(reports);
    if !bw.is_empty() {
        let caption = "one-way put bandwidth versus size";
        write_svg(&out.join("bandwidth.svg"), (900, 560), |a| {
            chart(
                a,
                caption,
                "message size (bytes)",
                "GB/s",
                true,
                Legend::LowerRight,
                &bw,
            )
        })?;
        made.push(("bandwidth.svg".to_owned(), caption.to_owned()));
    }
    let panels = loggp_panels(reports);
    if !panels.is_empty() {
        let caption = "all-to-all: LogGP prediction (dashed) versus measurement (solid)";
        let w = 520 * panels.len() as u32;
        write_svg(&out.join("loggp.svg"), (w, 520), |a| {
            let areas = a.split_evenly((1, panels.len()));
            for (area, (title, lines)) in areas.iter().zip(&panels) {
                chart(
                    area,
                    title,
                    "ranks",
                    "µs per iteration",
                    false,
                    Legend::UpperLeft,
                    lines,
                )?;
            }
            Ok(())
        })?;
        made.push(("loggp.svg".to_owned(), caption.to_owned()));
    }
    Ok(made)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(bench: &str, label: &str) -> Job {
        Job {
            name: format!("{bench}-x"),
            bench: bench.to_owned(),
            path_label: label.to_owned(),
            args: vec![bench.to_owned()],
            env: Vec::new(),
        }
    }

    #[test]
    fn plots_are_written_from_reports() {
        let pp = serde_json::json!({"results": {"floor": "raw", "sizes": [
            {"bytes": 8, "row": {"us": {"median": 0.1}, "floor_us": {"median": 0.05}}},
            {"bytes": 65536, "row": {"us": {"median": 1.6}, "floor_us": {"median": 1.5}}}
        ]}});
        let lg = serde_json::json!({"results": {"predictions": [
            {"ranks": 2, "bytes": 8, "measured": {"median": 0.3}, "prediction": {"us": 0.2}},
            {"ranks": 4, "bytes": 8, "measured": {"median": 12.0}, "prediction": {"us": 16.0}}
        ]}});
        let reports = vec![
            (job("pingpong", "direct"), pp),
            (job("loggp", "direct"), lg),
        ];
        let dir = std::env::temp_dir().join(format!("xtask-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let made = all(&dir, &reports).unwrap();
        assert_eq!(made.len(), 2);
        let svg = std::fs::read_to_string(dir.join("latency.svg")).unwrap();
        assert!(svg.starts_with("<svg") && svg.contains("direct"));
        let svg = std::fs::read_to_string(dir.join("loggp.svg")).unwrap();
        assert!(svg.contains("LogGP"));
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(latency_lines(&reports).len(), 2);
        assert_eq!(human_bytes(65536.0), "64k");
    }
}
