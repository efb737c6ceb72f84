//! Human-readable numbers, simple aligned tables, and the progress bar of
//! long work.

/// The progress bar of `len` steps of long work: the bar, the count, the
/// time spent and left, and a message.
pub fn progress_bar(len: u64) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::new(len);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} [{elapsed} < {eta}] {msg}")
            .expect("a valid template"),
    );
    bar
}

/// `1.23 GFLOP`-style scaling with SI prefixes.
pub fn si(value: f64, unit: &str) -> String {
    if value == 0.0 {
        return format!("0 {unit}");
    }
    let prefixes = [(1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")];
    for (scale, p) in prefixes {
        if value >= scale {
            return format!("{} {p}{unit}", sig3(value / scale));
        }
    }
    format!("{} {unit}", sig3(value))
}

/// Three significant figures, without trailing zeros in the fraction.
pub fn sig3(v: f64) -> String {
    let digits = if v >= 100.0 {
        0
    } else if v >= 10.0 {
        1
    } else {
        2
    };
    let s = format!("{v:.digits$}");
    if s.contains('.') {
        s.trim_end_matches('0').trim_end_matches('.').to_string()
    } else {
        s
    }
}

/// A duration in seconds as µs, ms or s.
pub fn seconds(s: f64) -> String {
    if s < 1e-3 {
        format!("{} µs", sig3(s * 1e6))
    } else if s < 1.0 {
        format!("{} ms", sig3(s * 1e3))
    } else {
        format!("{} s", sig3(s))
    }
}

/// Left-aligned columns, except those listed in `right`.
pub fn table(header: &[&str], rows: &[Vec<String>], right: &[usize]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate() {
            widths[i] = widths[i].max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let mut s = String::new();
        for (i, c) in cells.iter().enumerate() {
            let pad = widths[i] - c.chars().count();
            if i > 0 {
                s.push_str("  ");
            }
            if right.contains(&i) {
                s.push_str(&" ".repeat(pad));
                s.push_str(c);
            } else {
                s.push_str(c);
                if i + 1 < cells.len() {
                    s.push_str(&" ".repeat(pad));
                }
            }
        }
        s.push('\n');
        s
    };
    let mut out = line(header.to_vec());
    for row in rows {
        out.push_str(&line(row.iter().map(String::as_str).collect()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn numbers_read_naturally() {
        assert_eq!(si(0.0, "FLOP"), "0 FLOP");
        assert_eq!(si(2.0 * 4096f64.powi(3), "FLOP"), "137 GFLOP");
        assert_eq!(si(1536.0, "B"), "1.54 kB");
        assert_eq!(seconds(2.5e-5), "25 µs");
        assert_eq!(seconds(0.1234), "123 ms");
    }

    #[test]
    fn tables_align_columns() {
        let t = table(&["a", "num"], &[vec!["xyz".into(), "1".into()]], &[1]);
        assert_eq!(t, "a    num\nxyz    1\n");
    }
}
