//! Byte sizes on the command line: `10GB`, `512MiB`, `1.5 TiB`, `1000000`.

/// Parses a byte size: a number (decimals allowed with a unit) and an optional unit, decimal
/// (`B`, `KB`, `MB`, `GB`, `TB`, `PB`: powers of 1000) or binary (`KiB`, `MiB`, `GiB`, `TiB`,
/// `PiB`: powers of 1024), case-insensitive; `K`/`M`/`G`/`T` alone are binary, as in `ls -h`.
pub fn parse_bytes(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !(c.is_ascii_digit() || c == '.' || c == '_')).unwrap_or(t.len());
    let (num, unit) = (t[..split].replace('_', ""), t[split..].trim());
    let bad =
        || format!("invalid byte size {s:?}: expected a number with an optional unit (e.g. 10GB, 512MiB, 1073741824)");
    if num.is_empty() {
        return Err(bad());
    }
    let mult: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1000,
        "mb" => 1000u64.pow(2),
        "gb" => 1000u64.pow(3),
        "tb" => 1000u64.pow(4),
        "pb" => 1000u64.pow(5),
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "p" | "pib" => 1 << 50,
        _ => return Err(bad()),
    };
    if let Ok(n) = num.parse::<u64>() {
        return n.checked_mul(mult).ok_or_else(|| format!("byte size {s:?} is too large"));
    }
    let f: f64 = num.parse().map_err(|_| bad())?;
    let v = (f * mult as f64).round();
    if !v.is_finite() || v < 0.0 || v >= u64::MAX as f64 {
        return Err(format!("byte size {s:?} is too large"));
    }
    Ok(v as u64)
}

#[cfg(test)]
mod tests {
    use super::parse_bytes;

    #[test]
    fn units() {
        assert_eq!(parse_bytes("10GB"), Ok(10_000_000_000));
        assert_eq!(parse_bytes("512MiB"), Ok(512 << 20));
        assert_eq!(parse_bytes("1.5 GiB"), Ok(3 << 29));
        assert_eq!(parse_bytes("1000"), Ok(1000));
        assert_eq!(parse_bytes("2k"), Ok(2048));
        assert_eq!(parse_bytes("7b"), Ok(7));
        assert!(parse_bytes("GB").is_err());
        assert!(parse_bytes("10 parsecs").is_err());
        assert!(parse_bytes("99999999999PB").is_err());
    }
}
