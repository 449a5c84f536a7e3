//! PNG bar chart of a `ForwardReport`: one panel per metric, one bar per system. Systems that
//! were not measured get no bar and an "n/a" label (never a zero that looks like a result).

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{ForwardOpts, SystemReport};

    #[test]
    fn draws_a_png_even_with_a_failed_system() {
        if !Path::new(FONT_PATH).exists() {
            panic!("{FONT_PATH} missing: install fonts-dejavu-core");
        }
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
        let bytes = std::fs::read(&p).expect("png written");
        assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
        assert!(
            bytes.len() > 5000,
            "suspiciously small png: {} bytes",
            bytes.len()
        );
        std::fs::remove_file(&p).expect("cleanup");
    }
}
