//! The planner's SVG as an operator sees it: rendered by headless Chromium
//! (Debian's `chromium-headless-shell`, or `TORPOR_CHROMIUM`) to a PNG,
//! then checked pixel by pixel against what the SVG says it draws: every
//! label has ink where it is anchored, every axis line is drawn, every data
//! point of every series is in its colour, and the page stays a light
//! background with dark ink (readable). `scripts/test` leaves this out
//! where no Chromium is installed.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

mod common;

use common::{stderr, torpor, wait_output, Scratch};

/// Bursty sessions on a 1 GiB pod: something in each of the three panels.
const TRACE: &str = r#"{"t":0,"sandbox":"a","event":"create","mem_mib":512}
{"t":0.1,"sandbox":"b","event":"create","mem_mib":512}
{"t":0.2,"sandbox":"c","event":"create","mem_mib":512}
{"t":1,"sandbox":"a","event":"request","duration_ms":300,"mem_mib":300}
{"t":1,"sandbox":"b","event":"request","duration_ms":300,"mem_mib":200}
{"t":30,"sandbox":"a","event":"request","duration_ms":10}
{"t":30,"sandbox":"b","event":"request","duration_ms":10}
{"t":30,"sandbox":"c","event":"request","duration_ms":10}
{"t":40,"sandbox":"a","event":"delete"}
"#;

/// How long Chromium may take to start and render.
const RENDER_LIMIT: Duration = Duration::from_secs(120);

fn chromium() -> PathBuf {
    if let Some(p) = std::env::var_os("TORPOR_CHROMIUM") {
        return PathBuf::from(p);
    }
    ["chromium-headless-shell", "chromium"]
        .iter()
        .flat_map(|n| ["/usr/bin", "/usr/lib/chromium"].map(|d| Path::new(d).join(n)))
        .find(|p| p.is_file())
        .expect("no chromium-headless-shell (apt-get install chromium-headless-shell)")
}

/// The value of attribute `name` in one element's tag text.
fn attr<'a>(tag: &'a str, name: &str) -> Option<&'a str> {
    let key = format!(" {name}=\"");
    let start = tag.find(&key)? + key.len();
    let len = tag[start..].find('"')?;
    Some(&tag[start..start + len])
}

fn num(tag: &str, name: &str) -> f64 {
    attr(tag, name)
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no number {name} in {tag}"))
}

/// Each `<NAME ...>` element's tag text with what follows it up to the
/// next `<` (a text element's content).
fn elements<'a>(svg: &'a str, name: &str) -> Vec<(&'a str, &'a str)> {
    let open = format!("<{name} ");
    svg.match_indices(&open)
        .map(|(at, _)| {
            let rest = &svg[at..];
            let end = rest.find('>').expect("unclosed tag");
            let body = &rest[end + 1..];
            (&rest[..end], &body[..body.find('<').unwrap_or(body.len())])
        })
        .collect()
}

/// The screenshot as RGB rows.
struct Shot {
    width: usize,
    height: usize,
    rgb: Vec<[u8; 3]>,
}

impl Shot {
    fn decode(path: &Path) -> Shot {
        let file = std::fs::File::open(path).expect("open the screenshot");
        let mut reader = png::Decoder::new(file).read_info().expect("a PNG");
        let mut buf = vec![0; reader.output_buffer_size()];
        let info = reader.next_frame(&mut buf).expect("a PNG frame");
        assert_eq!(info.bit_depth, png::BitDepth::Eight, "{info:?}");
        let step = match info.color_type {
            png::ColorType::Rgb => 3,
            png::ColorType::Rgba => 4,
            other => panic!("unexpected PNG colour type {other:?}"),
        };
        let rgb = buf[..info.buffer_size()]
            .chunks(step)
            .map(|p| [p[0], p[1], p[2]])
            .collect();
        Shot {
            width: info.width as usize,
            height: info.height as usize,
            rgb,
        }
    }

    fn at(&self, x: i64, y: i64) -> Option<[u8; 3]> {
        let (x, y) = (usize::try_from(x).ok()?, usize::try_from(y).ok()?);
        (x < self.width && y < self.height).then(|| self.rgb[y * self.width + x])
    }

    /// Pixels in the box (inclusive) that `pred` accepts.
    fn count(&self, x0: f64, y0: f64, x1: f64, y1: f64, pred: impl Fn([u8; 3]) -> bool) -> usize {
        let mut n = 0;
        for y in y0.floor() as i64..=y1.ceil() as i64 {
            for x in x0.floor() as i64..=x1.ceil() as i64 {
                n += self.at(x, y).is_some_and(&pred) as usize;
            }
        }
        n
    }
}

fn ink(p: [u8; 3]) -> bool {
    p.iter().map(|&c| c as u32).sum::<u32>() < 3 * 200
}

fn hex(colour: &str) -> [u8; 3] {
    let c = colour.trim_start_matches('#');
    let v = u32::from_str_radix(c, 16).unwrap_or_else(|_| panic!("colour {colour}"));
    [(v >> 16) as u8, (v >> 8) as u8, v as u8]
}

fn near(p: [u8; 3], want: [u8; 3]) -> bool {
    p.iter().zip(want).all(|(&a, b)| a.abs_diff(b) <= 48)
}

#[test]
fn plan_svg_renders_readably_in_a_browser() {
    let s = Scratch::new("plan-svg");
    let trace = s.path("t.jsonl");
    std::fs::write(&trace, TRACE).unwrap();
    let svg_path = s.path("plan.svg");
    let o = torpor(
        &[
            "plan",
            "--trace",
            trace.to_str().unwrap(),
            "--pod-mem-gib",
            "1",
            "--ratios",
            "1,2,4",
            "--keep-alive-ms",
            "5000",
            "--data-dir",
            "/nonexistent-torpor-plan-test",
            "--svg",
            svg_path.to_str().unwrap(),
        ],
        Duration::from_secs(60),
    );
    assert!(o.status.success(), "{}", stderr(&o));
    let svg = std::fs::read_to_string(&svg_path).unwrap();
    let (root, _) = elements(&svg, "svg")[0];
    let (width, height) = (num(root, "width"), num(root, "height"));

    let png = s.path("plan.png");
    let child = Command::new(chromium())
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            &format!("--user-data-dir={}", s.path("profile").display()),
            &format!("--window-size={width},{height}"),
            &format!("--screenshot={}", png.display()),
        ])
        .arg(format!("file://{}", svg_path.display()))
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(s.path("chromium.log")).unwrap())
        .spawn()
        .expect("start chromium");
    let o = wait_output(child, RENDER_LIMIT);
    assert!(
        o.status.success() && png.is_file(),
        "chromium: {}\n{}",
        o.status,
        std::fs::read_to_string(s.path("chromium.log")).unwrap_or_default()
    );
    let shot = Shot::decode(&png);
    assert_eq!((shot.width, shot.height), (width as usize, height as usize));

    // A light page with dark ink: most pixels near white, some ink.
    let light = shot.count(0.0, 0.0, width - 1.0, height - 1.0, |p| {
        p.iter().all(|&c| c >= 230)
    });
    let total = shot.width * shot.height;
    assert!(light * 10 >= total * 7, "{light} of {total} pixels light");

    // Every label has ink where it is anchored: titles, tick values, axis
    // names (rotated ones around their anchor), line labels.
    let texts = elements(&svg, "text");
    assert!(texts.len() >= 20, "only {} labels", texts.len());
    for (tag, content) in &texts {
        let content = content.trim();
        if content.is_empty() {
            continue;
        }
        let (x, y) = (num(tag, "x"), num(tag, "y"));
        let size = attr(tag, "font-size").map_or(12.0, |v| v.parse().unwrap());
        let run = content.chars().count() as f64 * size * 0.62;
        let (x0, x1, y0, y1) = if attr(tag, "transform").is_some() {
            (x - size, x + 2.0, y - run / 2.0 - 2.0, y + run / 2.0 + 2.0)
        } else {
            let (x0, x1) = match attr(tag, "text-anchor") {
                Some("middle") => (x - run / 2.0, x + run / 2.0),
                Some("end") => (x - run, x),
                _ => (x, x + run),
            };
            (x0 - 2.0, x1 + 2.0, y - size, y + 3.0)
        };
        let dark = shot.count(x0, y0, x1, y1, |p| !p.iter().all(|&c| c >= 230));
        let want = (content.chars().filter(|c| !c.is_whitespace()).count() * 3).max(4);
        assert!(
            dark >= want,
            "label {content:?} at ({x}, {y}) has {dark} inked pixels (want {want})"
        );
    }

    // Every axis (black line) is drawn along its length.
    let axes: Vec<_> = elements(&svg, "line")
        .into_iter()
        .filter(|(t, _)| attr(t, "stroke") == Some("black"))
        .collect();
    assert!(axes.len() >= 6, "only {} axis lines", axes.len());
    for (tag, _) in axes {
        let (x1, y1, x2, y2) = (
            num(tag, "x1"),
            num(tag, "y1"),
            num(tag, "x2"),
            num(tag, "y2"),
        );
        for k in 1..10 {
            let f = k as f64 / 10.0;
            let (x, y) = (x1 + (x2 - x1) * f, y1 + (y2 - y1) * f);
            let n = shot.count(x - 1.0, y - 1.0, x + 1.0, y + 1.0, ink);
            assert!(n > 0, "axis {tag}> is not drawn at ({x:.0}, {y:.0})");
        }
    }

    // Every data point of every series is drawn in the series' colour.
    let series = elements(&svg, "polyline");
    assert!(series.len() >= 3, "only {} series", series.len());
    for (tag, _) in series {
        let colour = hex(attr(tag, "stroke").expect("a series colour"));
        for point in attr(tag, "points").unwrap().split_whitespace() {
            let (x, y) = point.split_once(',').unwrap();
            let (x, y): (f64, f64) = (x.parse().unwrap(), y.parse().unwrap());
            let n = shot.count(x - 2.0, y - 2.0, x + 2.0, y + 2.0, |p| near(p, colour));
            assert!(n > 0, "series {colour:?}: no point drawn at ({x}, {y})");
        }
    }
}
