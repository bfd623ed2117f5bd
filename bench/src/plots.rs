//! PNG plots with plotters (bitmap backend; text through ab_glyph with DejaVu Sans from Debian's
//! fonts-dejavu-core, read at run time and never committed).

use std::path::Path;

use anyhow::{anyhow, Context};
use plotters::prelude::*;
use plotters::style::FontStyle;

use crate::parts::{CacheResults, HotResults, ScaleResults};

/// Where the font is looked for (Debian fonts-dejavu-core, or BENCH_FONT).
const FONT_PATHS: &[&str] = &["/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf", "/usr/share/fonts/TTF/DejaVuSans.ttf"];

pub fn register_font() -> anyhow::Result<()> {
    let path = std::env::var("BENCH_FONT")
        .ok()
        .or_else(|| FONT_PATHS.iter().find(|p| Path::new(p).exists()).map(|p| p.to_string()))
        .context("no TTF font found: install Debian's fonts-dejavu-core (bench/run does) or set BENCH_FONT")?;
    let bytes: &'static [u8] = Box::leak(std::fs::read(&path)?.into_boxed_slice());
    plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).map_err(|_| anyhow!("{path} is not a usable font"))?;
    Ok(())
}

const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

fn err<E: std::fmt::Debug>(e: E) -> anyhow::Error {
    anyhow!("plotting: {e:?}")
}

/// Backlog over time of the hot-prefix runs, one line per shard count.
pub fn hot_backlog(r: &HotResults, out: &Path) -> anyhow::Result<()> {
    let root = BitMapBackend::new(out, (1000, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let t_max = r.rows.iter().flat_map(|x| x.backlog.last().map(|b| b.0)).fold(r.load_s, f64::max);
    let y_max = r.rows.iter().map(|x| x.peak_backlog).max().unwrap_or(1).max(1) as f64 * 1.1;
    let mut chart = ChartBuilder::on(&root)
        .caption("Hot prefix under a sine load: backlog (requests published, not yet answered)", ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..t_max, 0f64..y_max)
        .map_err(err)?;
    chart
        .configure_mesh()
        .light_line_style(RGBColor(235, 235, 235))
        .x_desc("seconds since start")
        .y_desc("outstanding requests")
        .x_label_formatter(&|x| format!("{x:.0}"))
        .y_label_formatter(&|y| format!("{y:.0}"))
        .draw()
        .map_err(err)?;
    for (i, row) in r.rows.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        chart
            .draw_series(LineSeries::new(row.backlog.iter().map(|&(t, b)| (t, b as f64)), c.stroke_width(2)))
            .map_err(err)?
            .label(row.label())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
    }
    let grey = RGBColor(60, 60, 60);
    chart
        .draw_series(std::iter::once(PathElement::new(vec![(r.load_s, 0.0), (r.load_s, y_max)], grey.stroke_width(2))))
        .map_err(err)?
        .label("load ends")
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], grey.stroke_width(2)));
    chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).position(SeriesLabelPosition::UpperRight).draw().map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

/// Block hit ratio against the number of instances M: measured keyed and off, the offline
/// routing model, and the oracle.
pub fn scale_hits(r: &ScaleResults, key_blocks: usize, out: &Path) -> anyhow::Result<()> {
    let root = BitMapBackend::new(out, (1000, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption("Mooncake replay on simulated vLLM servers: prefix-cache block hit ratio vs instances", ("sans-serif", 20))
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d((0.5f64..8.5f64).log_scale(), 0f64..(r.oracle_sample_16.max(r.oracle_trace_512) * 110.0).max(10.0))
        .map_err(err)?;
    chart
        .configure_mesh()
        .light_line_style(RGBColor(235, 235, 235))
        .x_desc("instances M (one simulated server each)")
        .y_desc("block hit ratio, %")
        .y_label_formatter(&|y| format!("{y:.0}"))
        .x_label_formatter(&|x| format!("{x:.0}"))
        .draw()
        .map_err(err)?;
    let series = |mode: &str, kb: usize| -> Vec<(f64, f64)> {
        let mut v: Vec<(f64, f64)> = r
            .rows
            .iter()
            .filter(|x| x.mode == mode && (mode != "static" || x.key_blocks == kb))
            .map(|x| (x.m as f64, x.block_hit_ratio * 100.0))
            .collect();
        v.sort_by(|a, b| a.0.total_cmp(&b.0));
        v
    };
    let model = |mode: &str, kb: usize| -> Vec<(f64, f64)> {
        r.offline.iter().filter(|x| x.mode == mode && x.key_blocks == kb).map(|x| (x.m as f64, x.block_hit_ratio * 100.0)).collect()
    };
    // (label, points, colour, measured?)
    #[allow(clippy::type_complexity)]
    let lines: [(String, Vec<(f64, f64)>, RGBColor, bool); 4] = [
        ("keyed (adaptive), measured".into(), series("keyed", 0), COLORS[0], true),
        ("off, measured".into(), series("off", 0), COLORS[1], true),
        (format!("static {key_blocks}-block key, routing model"), model("keyed", key_blocks), COLORS[0], false),
        ("off, routing model".into(), model("off", 0), COLORS[1], false),
    ];
    for (label, pts, c, solid) in lines {
        let style = if solid { c.stroke_width(3) } else { c.mix(0.5).stroke_width(1) };
        chart
            .draw_series(LineSeries::new(pts.clone(), style))
            .map_err(err)?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
        chart.draw_series(pts.iter().map(|&p| Circle::new(p, if solid { 5 } else { 3 }, c.filled()))).map_err(err)?;
    }
    let o = r.oracle_sample_16 * 100.0;
    let grey = RGBColor(90, 90, 90);
    chart
        .draw_series(LineSeries::new(vec![(0.5, o), (8.5, o)], grey.stroke_width(2)))
        .map_err(err)?
        .label(format!("oracle of the replayed sample ({o:.1}%)"))
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], grey.stroke_width(2)));
    chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).position(SeriesLabelPosition::LowerRight).draw().map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

/// Backlog over (model) time of the Mooncake replay: one panel per M, keyed vs off.
pub fn scale_backlog(r: &ScaleResults, out: &Path) -> anyhow::Result<()> {
    let root = BitMapBackend::new(out, (1100, 760)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let root = root.titled("Mooncake replay: backlog over trace time (requests published, not yet answered)", ("sans-serif", 20)).map_err(err)?;
    let mut ms: Vec<usize> = r.rows.iter().map(|x| x.m).collect();
    ms.sort();
    ms.dedup();
    let t_max = r.rows.iter().flat_map(|x| x.backlog.last().map(|b| b.0)).fold(1.0, f64::max);
    let cols = 2;
    let rows_n = ms.len().div_ceil(cols).max(1);
    let panels = root.split_evenly((rows_n, cols));
    for (panel, m) in panels.iter().zip(&ms) {
        let rows: Vec<_> = r.rows.iter().filter(|x| x.m == *m && x.mode != "static").collect();
        let y_max = rows.iter().map(|x| x.peak_backlog).max().unwrap_or(1).max(1) as f64 * 1.15;
        let mut chart = ChartBuilder::on(panel)
            .caption(format!("M = {m}"), ("sans-serif", 16))
            .margin(10)
            .x_label_area_size(35)
            .y_label_area_size(55)
            .build_cartesian_2d(0f64..t_max, 0f64..y_max)
            .map_err(err)?;
        chart
            .configure_mesh()
            .light_line_style(RGBColor(235, 235, 235))
            .x_desc("trace seconds")
            .y_desc("outstanding")
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_label_formatter(&|y| format!("{y:.0}"))
            .draw()
            .map_err(err)?;
        for row in rows {
            let c = if row.mode == "keyed" { COLORS[0] } else { COLORS[1] };
            chart
                .draw_series(LineSeries::new(row.backlog.iter().map(|&(t, b)| (t, b as f64)), c.stroke_width(2)))
                .map_err(err)?
                .label(if row.mode == "keyed" { "keyed (adaptive)".to_owned() } else { "off".to_owned() })
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
        }
        chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).position(SeriesLabelPosition::UpperRight).draw().map_err(err)?;
    }
    root.present().map_err(err)?;
    Ok(())
}

/// Cached prompt-token ratio per dataset: keyed vs off, both server caches, with the oracle.
pub fn cache_ratio(r: &CacheResults, out: &Path) -> anyhow::Result<()> {
    let root = BitMapBackend::new(out, (1100, 580)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let names: Vec<String> = r.datasets.iter().map(|d| d.sample.dataset.clone()).collect();
    let n = names.len().max(1);
    let mut chart = ChartBuilder::on(&root)
        .caption(
            if r.rows.iter().any(|x| x.rep > 0) {
                "Real llama-server (SmolLM2-135M, 2 instances): cached prompt-token ratio (median; line: min–max)"
            } else {
                "Real llama-server (SmolLM2-135M, 2 instances): cached prompt-token ratio"
            },
            ("sans-serif", 20),
        )
        .margin(15)
        .x_label_area_size(45)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..n as f64, 0f64..100f64)
        .map_err(err)?;
    let labels = names.clone();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(n * 2 + 1)
        .x_label_formatter(&move |x| {
            let i = x.floor() as usize;
            if (x - i as f64 - 0.5).abs() < 0.01 {
                labels.get(i).cloned().unwrap_or_default()
            } else {
                String::new()
            }
        })
        .y_desc("cached prompt tokens, %")
        .y_label_formatter(&|y| format!("{y:.0}"))
        .draw()
        .map_err(err)?;
    let bars = [("small", "keyed", 0usize), ("small", "off", 1), ("host", "keyed", 2), ("host", "off", 3)];
    let colors = [COLORS[0], COLORS[1], RGBColor(120, 170, 220), RGBColor(255, 190, 120)];
    let w = 0.8 / bars.len() as f64;
    let mut all_spreads = Vec::new();
    for (bi, (cache, mode, _)) in bars.iter().enumerate() {
        let c = colors[bi];
        if !r.rows.iter().any(|x| x.cache == *cache && x.mode == *mode) {
            continue; // e.g. the host cache in medium mode
        }
        let rects: Vec<_> = names
            .iter()
            .enumerate()
            .filter_map(|(di, ds)| {
                // The median over repetitions (one run in quick and full mode).
                let (ratio, _, _) = crate::parts::cache_stat(&r.rows, ds, cache, mode, |x| x.cached_ratio)?;
                let x0 = di as f64 + 0.1 + bi as f64 * w;
                Some(Rectangle::new([(x0, 0.0), (x0 + w * 0.92, ratio * 100.0)], c.filled()))
            })
            .collect();
        // The spread (min–max) over repetitions, as a line through the bar's middle.
        let spreads = names
            .iter()
            .enumerate()
            .filter_map(|(di, ds)| {
                let (_, lo, hi) = crate::parts::cache_stat(&r.rows, ds, cache, mode, |x| x.cached_ratio)?;
                let xm = di as f64 + 0.1 + bi as f64 * w + w * 0.46;
                (hi > lo).then(|| PathElement::new(vec![(xm, lo * 100.0), (xm, hi * 100.0)], BLACK.stroke_width(2)))
            });
        all_spreads.extend(spreads);
        let label = format!("{mode}, {} cache", if *cache == "small" { "small (--cache-ram 0)" } else { "host (--cache-ram 8192)" });
        chart
            .draw_series(rects)
            .map_err(err)?
            .label(label)
            .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 16, y + 6)], c.filled()));
    }
    chart.draw_series(all_spreads).map_err(err)?;
    let black = BLACK;
    chart
        .draw_series(r.datasets.iter().enumerate().map(|(di, d)| {
            PathElement::new(vec![(di as f64 + 0.06, d.oracle * 100.0), (di as f64 + 0.94, d.oracle * 100.0)], black.stroke_width(3))
        }))
        .map_err(err)?
        .label("oracle of the sample")
        .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], black.stroke_width(3)));
    chart.configure_series_labels().background_style(WHITE.mix(0.85)).border_style(BLACK).position(SeriesLabelPosition::UpperRight).draw().map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

/// Part 7: server-side token hit ratio vs M, one line per route, one panel per workload, with
/// each workload's oracle.
pub fn peers_hits(r: &crate::peers::PeersResults, out: &Path) -> anyhow::Result<()> {
    let root = BitMapBackend::new(out, (1200, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let root = root.titled("Same servers, same traffic: server-side prefix-cache token hit ratio vs servers M, per route", ("sans-serif", 20)).map_err(err)?;
    // A workload run at one M only (the hot-prefix ones) has no line to draw.
    let workloads: Vec<&crate::peers::PeerWorkload> = r.workloads.iter().filter(|w| r.ms(&w.name).len() > 1).collect();
    let panels = root.split_evenly((1, workloads.len().max(1)));
    let mut routes: Vec<String> = Vec::new();
    for row in &r.rows {
        if !routes.contains(&row.route()) {
            routes.push(row.route());
        }
    }
    let m_max = r.rows.iter().map(|x| x.m).max().unwrap_or(8).max(2) as f64;
    for (panel, w) in panels.iter().zip(workloads) {
        let mut chart = ChartBuilder::on(panel)
            .caption(format!("{} (oracle {:.1} %)", w.name, w.oracle * 100.0), ("sans-serif", 16))
            .margin(10)
            .x_label_area_size(40)
            .y_label_area_size(55)
            .build_cartesian_2d(1f64..m_max + 1.0, 0f64..100f64)
            .map_err(err)?;
        chart
            .configure_mesh()
            .light_line_style(RGBColor(235, 235, 235))
            .x_desc("servers M")
            .y_desc("token hit ratio, %")
            .x_label_formatter(&|x| format!("{x:.0}"))
            .y_label_formatter(&|y| format!("{y:.0}"))
            .draw()
            .map_err(err)?;
        for (i, route) in routes.iter().enumerate() {
            let mut pts: Vec<(f64, f64)> = r
                .rows
                .iter()
                .filter(|x| x.workload == w.name && &x.route() == route && x.error.is_none())
                .map(|x| (x.m as f64, x.token_hit_ratio * 100.0))
                .collect();
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
            let c = if i < COLORS.len() { COLORS[i] } else { RGBColor((40 * i % 255) as u8, 120, (70 * i % 255) as u8) };
            let style = if i == 0 { c.stroke_width(4) } else { c.stroke_width(2) };
            chart
                .draw_series(LineSeries::new(pts.clone(), style))
                .map_err(err)?
                .label(route.clone())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
            chart.draw_series(pts.iter().map(|&p| Circle::new(p, 4, c.filled()))).map_err(err)?;
        }
        let o = w.oracle * 100.0;
        let grey = RGBColor(90, 90, 90);
        chart.draw_series(LineSeries::new(vec![(1.0, o), (m_max + 1.0, o)], grey.stroke_width(1))).map_err(err)?;
        // The legend goes where the lines are not: above them when every ratio is low, else below.
        let pos = if w.oracle < 0.6 { SeriesLabelPosition::UpperLeft } else { SeriesLabelPosition::LowerLeft };
        chart.configure_series_labels().background_style(WHITE.mix(0.8)).border_style(BLACK).position(pos).draw().map_err(err)?;
    }
    root.present().map_err(err)?;
    Ok(())
}
