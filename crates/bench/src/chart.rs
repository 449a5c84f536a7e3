//! PNG charts: a bar chart of a `ForwardReport` (one panel per metric, one bar per system;
//! systems that were not measured get no bar and an "n/a" label, never a zero that looks like a
//! result), and line charts over time ([`draw_lines_png`]: panels stacked on one time axis, one
//! line per series, for runs such as `bench kv`'s).

use crate::{BenchError, ForwardReport};
use plotters::prelude::*;
use std::path::Path;
use std::sync::OnceLock;

/// DejaVu Sans from Debian's fonts-dejavu-core (installed with the lab packages).
pub const FONT_PATH: &str = "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf";

static FONT: OnceLock<Result<(), String>> = OnceLock::new();

/// plotters' ab_glyph backend needs the font bytes for the whole process lifetime; load and
/// register them once (the bytes are leaked deliberately: one font, once per process).
fn ensure_font() -> Result<(), BenchError> {
    FONT.get_or_init(|| {
        let bytes = std::fs::read(FONT_PATH).map_err(|e| format!("{FONT_PATH}: {e}"))?;
        let leaked: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        plotters::style::register_font("sans-serif", FontStyle::Normal, leaked)
            .map_err(|_| format!("{FONT_PATH}: not a usable font"))
    })
    .clone()
    .map_err(BenchError::Chart)
}

const COLORS: [RGBColor; 3] = [
    RGBColor(110, 110, 110),
    RGBColor(70, 110, 190),
    RGBColor(220, 120, 30),
];

pub fn draw_png(report: &ForwardReport, path: &Path) -> Result<(), BenchError> {
    ensure_font()?;
    let systems = report.systems();
    let names: Vec<&str> = systems.iter().map(|(n, _)| *n).collect();
    type Get = fn(&crate::SystemReport) -> Option<f64>;
    let panels: [(&str, Get); 4] = [
        ("TCP, 1 stream (Gbit/s)", |s| s.gbps_1stream),
        ("TCP, 4 streams (Gbit/s)", |s| s.gbps_4streams),
        ("64-byte UDP received (kpps)", |s| {
            s.pps_64b.map(|p| p / 1e3)
        }),
        ("ping RTT p50 (us)", |s| s.rtt_us_p50),
    ];
    let err = |e: &dyn std::fmt::Display| BenchError::Chart(e.to_string());
    let root = BitMapBackend::new(path, (1200, 820)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let (title, body) = root.split_vertically(50);
    title
        .draw(&Text::new(
            format!(
                "pliant bench forward ({} s per test, {} flows for pps)",
                report.duration_s, report.flows_64b
            ),
            (20, 15),
            ("sans-serif", 24).into_font(),
        ))
        .map_err(|e| err(&e))?;
    // Legend in the title strip: one colour per system, same order in every panel.
    for (i, name) in names.iter().enumerate() {
        let x = 760 + 150 * i as i32;
        title
            .draw(&Rectangle::new([(x, 18), (x + 16, 34)], COLORS[i].filled()))
            .map_err(|e| err(&e))?;
        title
            .draw(&Text::new(
                name.to_string(),
                (x + 22, 18),
                ("sans-serif", 16).into_font(),
            ))
            .map_err(|e| err(&e))?;
    }
    for (area, (label, get)) in body.split_evenly((2, 2)).iter().zip(panels.iter()) {
        let vals: Vec<Option<f64>> = systems.iter().map(|(_, s)| get(s)).collect();
        let max = vals.iter().flatten().copied().fold(0.0f64, f64::max);
        let top = if max > 0.0 { max * 1.25 } else { 1.0 };
        let mut chart = ChartBuilder::on(area)
            .caption(*label, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(30)
            .y_label_area_size(60)
            .build_cartesian_2d(0f64..3f64, 0f64..top)
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .disable_x_mesh()
            .x_labels(0)
            .label_style(("sans-serif", 14))
            .draw()
            .map_err(|e| err(&e))?;
        for (i, v) in vals.iter().enumerate() {
            let x = i as f64;
            if let Some(v) = v {
                chart
                    .draw_series(std::iter::once(Rectangle::new(
                        [(x + 0.15, 0.0), (x + 0.85, *v)],
                        COLORS[i].filled(),
                    )))
                    .map_err(|e| err(&e))?;
            }
            let text = match v {
                Some(v) if *v >= 100.0 => format!("{v:.0}"),
                Some(v) => format!("{v:.2}"),
                None => "n/a".to_string(),
            };
            let y = v.unwrap_or(0.0) + top * 0.02;
            chart
                .draw_series(std::iter::once(Text::new(
                    text,
                    (x + 0.3, y + top * 0.05),
                    ("sans-serif", 16).into_font(),
                )))
                .map_err(|e| err(&e))?;
        }
    }
    root.present().map_err(|e| err(&e))
}

/// One line of a [`Panel`]: `(x, y)` points in x order.
#[derive(Clone, Debug)]
pub struct Series {
    pub name: String,
    pub points: Vec<(f64, f64)>,
}

/// One chart of a [`draw_lines_png`] figure.
#[derive(Clone, Debug)]
pub struct Panel {
    pub title: String,
    pub series: Vec<Series>,
}

/// Line colours, by series name in order of first appearance over the panels (a name has the
/// same colour in every panel).
const LINE_COLORS: [RGBColor; 6] = [
    RGBColor(0, 0, 0),
    RGBColor(70, 110, 190),
    RGBColor(220, 120, 30),
    RGBColor(40, 150, 70),
    RGBColor(180, 50, 50),
    RGBColor(130, 80, 170),
];

/// Panels stacked over one shared x axis (`x_label`), each with its own y range from zero
/// and a legend. A panel with no points says so instead of drawing empty axes.
pub fn draw_lines_png(
    title: &str,
    x_label: &str,
    panels: &[Panel],
    path: &Path,
) -> Result<(), BenchError> {
    ensure_font()?;
    if panels.is_empty() {
        return Err(BenchError::Chart("no panels to draw".into()));
    }
    let err = |e: &dyn std::fmt::Display| BenchError::Chart(e.to_string());
    let points = panels
        .iter()
        .flat_map(|p| p.series.iter().flat_map(|s| s.points.iter()));
    let x_max = points.clone().map(|p| p.0).fold(0.0f64, f64::max).max(1.0);
    let mut names: Vec<&str> = Vec::new();
    for s in panels.iter().flat_map(|p| p.series.iter()) {
        if !names.contains(&s.name.as_str()) {
            names.push(&s.name);
        }
    }
    let height = 60 + 300 * panels.len() as u32;
    let root = BitMapBackend::new(path, (1200, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(&e))?;
    let (head, body) = root.split_vertically(50);
    head.draw(&Text::new(
        title.to_string(),
        (20, 15),
        ("sans-serif", 24).into_font(),
    ))
    .map_err(|e| err(&e))?;
    for (area, panel) in body.split_evenly((panels.len(), 1)).iter().zip(panels) {
        let y_max = panel
            .series
            .iter()
            .flat_map(|s| s.points.iter().map(|p| p.1))
            .fold(0.0f64, f64::max);
        let top = if y_max > 0.0 { y_max * 1.15 } else { 1.0 };
        let mut chart = ChartBuilder::on(area)
            .caption(&panel.title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(35)
            .y_label_area_size(80)
            .build_cartesian_2d(0f64..x_max, 0f64..top)
            .map_err(|e| err(&e))?;
        chart
            .configure_mesh()
            .x_desc(x_label)
            .label_style(("sans-serif", 14))
            .draw()
            .map_err(|e| err(&e))?;
        if panel.series.iter().all(|s| s.points.is_empty()) {
            chart
                .draw_series(std::iter::once(Text::new(
                    "no samples",
                    (x_max * 0.45, top * 0.5),
                    ("sans-serif", 18).into_font(),
                )))
                .map_err(|e| err(&e))?;
            continue;
        }
        for s in &panel.series {
            let i = names.iter().position(|n| *n == s.name).unwrap_or(0);
            let c = LINE_COLORS[i % LINE_COLORS.len()];
            chart
                .draw_series(LineSeries::new(s.points.iter().copied(), c.stroke_width(2)))
                .map_err(|e| err(&e))?
                .label(s.name.clone())
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 14))
            .draw()
            .map_err(|e| err(&e))?;
    }
    root.present().map_err(|e| err(&e))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ForwardOpts, SystemReport};

    fn need_font() {
        if !Path::new(FONT_PATH).exists() {
            panic!("{FONT_PATH} missing: install fonts-dejavu-core");
        }
    }

    /// A PNG of some substance was written at `p`; removes it.
    fn check_png_and_remove(p: &Path) {
        let bytes = std::fs::read(p).expect("png written");
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        assert!(
            bytes.len() > 5000,
            "suspiciously small png: {} bytes",
            bytes.len()
        );
        std::fs::remove_file(p).expect("cleanup");
    }

    #[test]
    fn draws_a_png_even_with_a_failed_system() {
        need_font();
        let kn = SystemReport {
            gbps_1stream: Some(16.2),
            gbps_4streams: Some(20.0),
            pps_64b: Some(80_000.0),
            rtt_us_p50: Some(30.0),
            ..Default::default()
        };
        let failed = SystemReport {
            error: Some("x".into()),
            ..Default::default()
        };
        let r = ForwardReport::new(&ForwardOpts::default(), [kn.clone(), kn, failed], 1.0);
        let p = std::env::temp_dir().join(format!("pliant-bench-chart-{}.png", std::process::id()));
        draw_png(&r, &p).expect("draw");
        check_png_and_remove(&p);
    }

    #[test]
    fn draws_lines_with_an_empty_panel() {
        need_font();
        let line = |name: &str, k: f64| Series {
            name: name.into(),
            points: (0..60)
                .map(|t| (t as f64, k * (t as f64 / 10.0).sin().abs()))
                .collect(),
        };
        let panels = [
            Panel {
                title: "writes/s".into(),
                series: vec![line("offered", 100.0), line("online", 90.0)],
            },
            Panel {
                title: "nothing measured".into(),
                series: vec![Series {
                    name: "online".into(),
                    points: vec![],
                }],
            },
        ];
        let p = std::env::temp_dir().join(format!("pliant-bench-lines-{}.png", std::process::id()));
        draw_lines_png("test", "seconds", &panels, &p).expect("draw");
        check_png_and_remove(&p);
        assert!(draw_lines_png("x", "s", &[], &p).is_err());
    }
}
