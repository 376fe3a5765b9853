//! What a bench's SDK driver (`benches/*_sdk.py`) prints: one JSON object
//! per line, `{"op", "client", "ms"}` per sample and `{"done": ...}` at the
//! end; other lines are ignored.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read};

use comfy_table::{presets::UTF8_FULL_CONDENSED, Table};

use super::{median, percentile};

/// The samples of a driver's output, keyed by (operation, client).
pub struct Samples {
    pub by_key: BTreeMap<(String, String), Vec<f64>>,
    /// The keys in the order they first appeared.
    pub order: Vec<(String, String)>,
    /// Whether the driver said it was done.
    pub done: bool,
}

impl Samples {
    /// Reads `out` to its end.
    pub fn read(out: impl Read) -> Samples {
        let mut samples = Samples {
            by_key: BTreeMap::new(),
            order: Vec::new(),
            done: false,
        };
        for line in BufReader::new(out).lines().map_while(Result::ok) {
            let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) else {
                continue;
            };
            if v.get("done").is_some() {
                samples.done = true;
                continue;
            }
            let (Some(op), Some(client), Some(ms)) =
                (v["op"].as_str(), v["client"].as_str(), v["ms"].as_f64())
            else {
                continue;
            };
            let key = (op.to_string(), client.to_string());
            if !samples.order.contains(&key) {
                samples.order.push(key.clone());
            }
            samples.by_key.entry(key).or_default().push(ms);
        }
        samples
    }

    /// The operations in the order they first appeared.
    pub fn ops(&self) -> Vec<String> {
        let mut ops: Vec<String> = Vec::new();
        for (op, _) in &self.order {
            if !ops.contains(op) {
                ops.push(op.clone());
            }
        }
        ops
    }

    /// A table of every (operation, client): its samples' count, p50 and
    /// p99 in ms, in the order they first appeared.
    pub fn table(&self) -> Table {
        let mut table = Table::new();
        table.load_style(UTF8_FULL_CONDENSED).set_header([
            "operation",
            "client",
            "n",
            "p50 ms",
            "p99 ms",
        ]);
        for key in &self.order {
            let v = &self.by_key[key];
            table.add_row([
                key.0.clone(),
                key.1.clone(),
                v.len().to_string(),
                format!("{:.1}", median(v.clone())),
                format!("{:.1}", percentile(v, 0.99)),
            ]);
        }
        table
    }
}
