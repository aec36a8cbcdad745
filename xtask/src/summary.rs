//! `cargo xtask loggp-summary FILE...`: the median over several `gin-bench
//! loggp --json` reports of one path, as Markdown: the parameters of each
//! run and their median, then predicted versus measured per rank count and
//! size (medians over the runs). Figures measured on a shared 2-core machine
//! move between runs; docs quote medians over three or more invocations.

use std::fmt::Write as _;
use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use serde_json::Value;

fn median(mut v: Vec<f64>) -> f64 {
    v.retain(|x| x.is_finite());
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        f64::midpoint(v[n / 2 - 1], v[n / 2])
    }
}

fn num(v: &Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
}

fn size(b: u64) -> String {
    if b >= 1 << 20 && b.is_multiple_of(1 << 20) {
        format!("{} MiB", b >> 20)
    } else if b >= 1 << 10 && b.is_multiple_of(1 << 10) {
        format!("{} KiB", b >> 10)
    } else {
        format!("{b} B")
    }
}

/// Parameters of one report: L, o, g, G (ns/KiB), then s(k) by k, hand-off.
fn params(v: &Value) -> (Vec<f64>, Vec<(u64, f64)>, f64) {
    let f = &v["results"]["fitted"];
    let base = vec![
        num(&f["l"]["value"]),
        num(&f["o"]["value"]),
        num(&f["g"]["value"]),
        num(&f["big_g"]["value"]) * 1024.0 * 1e3,
    ];
    let turns = f["turns"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|t| Some((t[0].as_u64()?, num(&t[1]["value"]))))
        .collect();
    (base, turns, num(&f["handoff"]["value"]))
}

pub fn run(args: &[String]) -> Result<()> {
    if args.is_empty() {
        bail!(
            "usage: cargo xtask loggp-summary FILE... (gin-bench loggp --json reports of one path)"
        );
    }
    let mut reports = Vec::new();
    for a in args {
        let p = PathBuf::from(a);
        let v: Value = serde_json::from_str(
            &std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))?,
        )
        .with_context(|| format!("parsing {}", p.display()))?;
        if v["bench"] != "loggp" {
            bail!("{} is not a loggp report", p.display());
        }
        reports.push((a.clone(), v));
    }
    let path = reports[0].1["results"]["path"]
        .as_str()
        .unwrap_or("?")
        .to_owned();
    if let Some((f, _)) = reports
        .iter()
        .find(|r| r.1["results"]["path"].as_str() != Some(&path))
    {
        bail!("{f} is of another path than {path}");
    }
    print!("{}", render(&path, &reports));
    Ok(())
}

fn render(path: &str, reports: &[(String, Value)]) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "Path `{path}`, {} runs.\n", reports.len());
    let _ = writeln!(
        s,
        "| run | L µs | o µs | g µs | G ns/KiB | s(k) µs | hand-off µs |"
    );
    let _ = writeln!(s, "| --- | --- | --- | --- | --- | --- | --- |");
    let mut cols: Vec<Vec<f64>> = vec![Vec::new(); 4];
    let mut turns: Vec<(u64, Vec<f64>)> = Vec::new();
    let mut handoffs = Vec::new();
    let fmt_turns = |t: &[(u64, f64)]| {
        t.iter()
            .map(|(k, v)| format!("{k}: {v:.2}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    for (name, v) in reports {
        let (base, t, h) = params(v);
        let file = std::path::Path::new(name)
            .file_name()
            .map_or_else(|| name.clone(), |f| f.to_string_lossy().into_owned());
        let _ = writeln!(
            s,
            "| {file} | {:.3} | {:.4} | {:.4} | {:.2} | {} | {h:.2} |",
            base[0],
            base[1],
            base[2],
            base[3],
            fmt_turns(&t)
        );
        for (c, x) in cols.iter_mut().zip(base) {
            c.push(x);
        }
        for (k, x) in t {
            match turns.iter_mut().find(|e| e.0 == k) {
                Some(e) => e.1.push(x),
                None => turns.push((k, vec![x])),
            }
        }
        handoffs.push(h);
    }
    let med: Vec<f64> = cols.into_iter().map(median).collect();
    let mt: Vec<(u64, f64)> = turns.into_iter().map(|(k, v)| (k, median(v))).collect();
    let _ = writeln!(
        s,
        "| **median** | **{:.3}** | **{:.4}** | **{:.4}** | **{:.2}** | **{}** | **{:.2}** |\n",
        med[0],
        med[1],
        med[2],
        med[3],
        fmt_turns(&mt),
        median(handoffs)
    );

    // Rows keyed by (ranks, bytes), in the first report's order.
    let rows: Vec<(u64, u64)> = reports[0].1["results"]["predictions"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|p| Some((p["ranks"].as_u64()?, p["bytes"].as_u64()?)))
        .collect();
    let _ = writeln!(
        s,
        "| ranks | size | ranks/core | predicted µs | measured µs (range over runs) | error | with the hand-off | assumptions |"
    );
    let _ = writeln!(s, "| --- | --- | --- | --- | --- | --- | --- | --- |");
    let (mut held, mut within, mut errs) = (0, 0, Vec::new());
    for (ranks, bytes) in rows {
        let mut pred = Vec::new();
        let mut meas = Vec::new();
        let mut hand = Vec::new();
        let mut holds = true;
        let mut per_core = 0;
        let mut ws = 0;
        for (_, v) in reports {
            for p in v["results"]["predictions"].as_array().into_iter().flatten() {
                if p["ranks"].as_u64() == Some(ranks) && p["bytes"].as_u64() == Some(bytes) {
                    pred.push(num(&p["prediction"]["us"]));
                    meas.push(num(&p["measured"]["median"]));
                    hand.push(num(&p["handoff_us"]));
                    holds &= p["assumptions_hold"].as_bool().unwrap_or(false);
                    per_core = p["prediction"]["per_core"].as_u64().unwrap_or(0);
                    ws = p["working_set"].as_u64().unwrap_or(0);
                }
            }
        }
        let (lo, hi) = meas
            .iter()
            .fold((f64::INFINITY, 0.0f64), |(a, b), &x| (a.min(x), b.max(x)));
        let (p, m, h) = (median(pred), median(meas), median(hand));
        let err = (p - m) / m * 100.0;
        if holds {
            held += 1;
            errs.push(err.abs());
            if err.abs() <= 25.0 {
                within += 1;
            }
        }
        let _ = writeln!(
            s,
            "| {ranks} | {} | {} | {p:.2} | {m:.2} ({lo:.2}–{hi:.2}) | {err:+.0} % | {h:.2} ({:+.0} %) | {} |",
            size(bytes),
            if per_core <= 1 {
                "1 (dedicated)".to_owned()
            } else {
                per_core.to_string()
            },
            (h - m) / m * 100.0,
            if holds {
                "hold".to_owned()
            } else {
                format!("working set {} beyond G's range", size(ws))
            }
        );
    }
    let _ = writeln!(
        s,
        "\n{within} of {held} rows where the assumptions hold are within ±25 %; median |error| there {:.0} %.",
        median(errs)
    );
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    fn report(l: f64, measured: f64) -> (String, Value) {
        (
            "r.json".to_owned(),
            serde_json::json!({"bench": "loggp", "results": {
                "path": "auto/auto",
                "fitted": {
                    "l": {"value": l}, "o": {"value": 0.04}, "g": {"value": 0.05},
                    "big_g": {"value": 3e-5}, "handoff": {"value": 9.0},
                    "turns": [[2, {"value": 5.0}]]
                },
                "predictions": [{
                    "ranks": 4, "bytes": 8, "prediction": {"us": 11.0, "per_core": 2},
                    "measured": {"median": measured}, "handoff_us": 19.0,
                    "assumptions_hold": true, "working_set": 256
                }]
            }}),
        )
    }

    #[test]
    fn medians_over_runs() {
        assert!((median(vec![3.0, 1.0, 2.0]) - 2.0).abs() < 1e-12);
        assert!((median(vec![4.0, 1.0, 2.0, 3.0]) - 2.5).abs() < 1e-12);
        assert!(median(vec![]).is_nan());
        let md = render(
            "auto/auto",
            &[report(0.05, 10.0), report(0.07, 12.0), report(0.06, 11.0)],
        );
        assert!(md.contains("| **median** | **0.060** |"), "{md}");
        // Predicted 11 against a median measurement of 11: 0 %.
        assert!(
            md.contains("| 4 | 8 B | 2 | 11.00 | 11.00 (10.00–12.00) | +0 % |"),
            "{md}"
        );
        assert!(md.contains("1 of 1 rows"), "{md}");
    }
}
