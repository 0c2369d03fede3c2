//! Ed25519 envelopes and trust sets.

use driftless_format::{sign, ErrorKind, Keypair, TrustSet};

const PAYLOAD: &[u8] = br#"{"kind":"delta","step":7}"#;

fn envelope(bytes: &[u8]) -> sign::Envelope {
    serde_json::from_slice(bytes).unwrap()
}

#[test]
fn seal_and_open() {
    let k = Keypair::from_seed([1; 32]);
    assert!(k.id().starts_with("ed25519:") && k.id().len() == 8 + 32, "{}", k.id());
    assert!(k.id()[8..].bytes().all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b)));
    assert_eq!(k.id(), sign::key_id(&k.public()));
    let env = k.seal(PAYLOAD).unwrap();
    let t = TrustSet::new().with_key(k.public());
    assert_eq!(t.len(), 1);
    assert_eq!(t.key_ids(), vec![k.id().to_string()]);
    let (p, signer) = t.open(&env).unwrap();
    assert_eq!(p, PAYLOAD);
    assert_eq!(signer.as_deref(), Some(k.id()));
    assert_ne!(Keypair::generate().id(), Keypair::generate().id());
    assert!(Keypair::from_seed([1; 32]).seal(&[0xff, 0xfe]).is_err(), "non-UTF-8 payload");
}

#[test]
fn refusals() {
    let k = Keypair::from_seed([1; 32]);
    let other = Keypair::from_seed([2; 32]);
    let env = k.seal(PAYLOAD).unwrap();
    let t = TrustSet::new().with_key(k.public());
    // Unknown key.
    let e = TrustSet::new().with_key(other.public()).open(&env).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Untrusted);
    assert_eq!(TrustSet::new().open(&env).unwrap_err().kind(), ErrorKind::Untrusted);
    // Tampered payload.
    let mut ev = envelope(&env);
    ev.payload = ev.payload.replace("7", "8");
    assert_eq!(t.open(&serde_json::to_vec(&ev).unwrap()).unwrap_err().kind(), ErrorKind::Untrusted);
    // Tampered signature, bad base64, wrong length.
    for sig in [
        {
            let mut s = envelope(&env).signatures[0].sig.clone().into_bytes();
            s[3] = if s[3] == b'A' { b'B' } else { b'A' };
            String::from_utf8(s).unwrap()
        },
        "!!!not base64".to_string(),
        "AAAA".to_string(),
    ] {
        let mut ev = envelope(&env);
        ev.signatures[0].sig = sig.clone();
        assert_eq!(t.open(&serde_json::to_vec(&ev).unwrap()).unwrap_err().kind(), ErrorKind::Untrusted, "{sig}");
    }
    // Signature by the trusted key moved to another key id: unknown key.
    let mut ev = envelope(&env);
    ev.signatures[0].key_id = other.id().to_string();
    assert_eq!(t.open(&serde_json::to_vec(&ev).unwrap()).unwrap_err().kind(), ErrorKind::Untrusted);
    // A signature without the domain prefix (same key, same payload) is not a manifest signature.
    use base64::Engine;
    use ed25519_dalek::Signer;
    let raw = ed25519_dalek::SigningKey::from_bytes(&[1; 32]).sign(PAYLOAD);
    let mut ev = envelope(&env);
    ev.signatures[0].sig = base64::engine::general_purpose::STANDARD.encode(raw.to_bytes());
    assert_eq!(t.open(&serde_json::to_vec(&ev).unwrap()).unwrap_err().kind(), ErrorKind::Untrusted);
    // Not an envelope at all.
    assert_eq!(t.open(b"{").unwrap_err().kind(), ErrorKind::Corrupt);
    assert_eq!(t.open(PAYLOAD).unwrap_err().kind(), ErrorKind::Corrupt);
}

#[test]
fn unsigned() {
    let env = sign::seal_unsigned(PAYLOAD).unwrap();
    assert!(envelope(&env).signatures.is_empty());
    let k = Keypair::from_seed([1; 32]);
    let strict = TrustSet::new().with_key(k.public());
    assert!(!strict.allows_unsigned());
    assert_eq!(strict.open(&env).unwrap_err().kind(), ErrorKind::Untrusted);
    // Regression (issue 9.7): with a key trusted, allow_unsigned must not accept a manifest
    // whose signatures were stripped.
    let lax = strict.clone().allow_unsigned(true);
    assert_eq!(lax.open(&env).unwrap_err().kind(), ErrorKind::Untrusted);
    // Unsigned passes only when no key is trusted at all.
    let open = TrustSet::new().allow_unsigned(true);
    assert!(open.allows_unsigned());
    assert_eq!(open.open(&env).unwrap(), (PAYLOAD.to_vec(), None));
    // allow_unsigned does not weaken signed envelopes.
    let mut ev = envelope(&k.seal(PAYLOAD).unwrap());
    ev.payload.push(' ');
    assert_eq!(lax.open(&serde_json::to_vec(&ev).unwrap()).unwrap_err().kind(), ErrorKind::Untrusted);
}

#[test]
fn key_rotation() {
    let old = Keypair::from_seed([1; 32]);
    let new = Keypair::from_seed([2; 32]);
    let both = TrustSet::new().with_key(old.public()).with_key(new.public());
    assert_eq!(both.len(), 2);
    let e_old = old.seal(PAYLOAD).unwrap();
    let e_new = new.seal(PAYLOAD).unwrap();
    assert_eq!(both.open(&e_old).unwrap().1.as_deref(), Some(old.id()));
    assert_eq!(both.open(&e_new).unwrap().1.as_deref(), Some(new.id()));
    // Dual-signed during the switch: accepted by a reader that only knows either key.
    let mut dual = envelope(&e_old);
    dual.signatures.extend(envelope(&e_new).signatures);
    let dual = serde_json::to_vec(&dual).unwrap();
    assert!(TrustSet::new().with_key(old.public()).open(&dual).is_ok());
    assert_eq!(TrustSet::new().with_key(new.public()).open(&dual).unwrap().1.as_deref(), Some(new.id()));
    // After dropping the old key.
    let only_new = TrustSet::new().with_key(new.public());
    assert_eq!(only_new.open(&e_old).unwrap_err().kind(), ErrorKind::Untrusted);
    // A signature by an unknown key next to a valid trusted one is ignored.
    let stranger = Keypair::from_seed([3; 32]);
    let mut ev = envelope(&stranger.seal(PAYLOAD).unwrap());
    ev.signatures.extend(envelope(&e_new).signatures);
    assert!(only_new.open(&serde_json::to_vec(&ev).unwrap()).is_ok());
}

#[test]
fn pem_round_trip() {
    let k = Keypair::from_seed([4; 32]);
    let pem = k.to_pem().unwrap();
    assert!(pem.contains("BEGIN PRIVATE KEY"), "{pem}");
    let k2 = Keypair::from_pem(&pem).unwrap();
    assert_eq!(k2.id(), k.id());
    assert_eq!(k2.public().as_bytes(), k.public().as_bytes());
    let ppem = k.public_pem().unwrap();
    assert!(ppem.contains("BEGIN PUBLIC KEY"), "{ppem}");
    assert_eq!(ppem, sign::public_to_pem(&k.public()).unwrap());
    let t = TrustSet::new().with_pem(&ppem).unwrap();
    assert_eq!(t.key_ids(), vec![k.id().to_string()]);
    assert_eq!(t.open(&k2.seal(PAYLOAD).unwrap()).unwrap().1.as_deref(), Some(k.id()));
    // Files.
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(dir.path().join("k.pem"), &pem).unwrap();
    std::fs::write(dir.path().join("k.pub"), &ppem).unwrap();
    assert_eq!(Keypair::read(&dir.path().join("k.pem")).unwrap().id(), k.id());
    assert_eq!(TrustSet::new().with_file(&dir.path().join("k.pub")).unwrap().key_ids(), vec![k.id().to_string()]);
    assert_eq!(Keypair::read(&dir.path().join("missing")).unwrap_err().kind(), ErrorKind::Io);
    // Garbage and swapped halves.
    assert_eq!(Keypair::from_pem("nope").unwrap_err().kind(), ErrorKind::InvalidInput);
    assert_eq!(Keypair::from_pem(&ppem).unwrap_err().kind(), ErrorKind::InvalidInput);
    assert_eq!(TrustSet::new().with_pem(&pem).unwrap_err().kind(), ErrorKind::InvalidInput);
    // Debug never prints the secret.
    let dbg = format!("{k:?}");
    assert!(dbg.contains(k.id()) && !dbg.contains(&pem[30..60]));
}

/// An envelope is hostile before its signature is checked, and its error is kept and logged
/// by agents: whatever it quotes (a parser's type error quotes the offending string whole; a
/// list of unknown key ids), the error is one bounded line (found by review: 60 MB envelopes
/// made 60 MB errors).
#[test]
fn an_envelope_error_is_one_bounded_line_whatever_it_quotes() {
    let k = Keypair::from_seed([1; 32]);
    let trust = TrustSet::new().with_key(k.public());
    let long = "y\n".repeat(8 << 20);
    let key_ids: Vec<String> =
        (0..8).map(|i| format!("{{\"key_id\":\"{i}{}\",\"sig\":\"\"}}", "k".repeat(1 << 20))).collect();
    for (what, env) in [
        (
            "a string where signatures go",
            format!("{{\"payload\":\"{{}}\",\"signatures\":\"{}\"}}", long.replace('\n', "\\n")),
        ),
        ("unknown key ids", format!("{{\"payload\":\"{{}}\",\"signatures\":[{}]}}", key_ids.join(","))),
    ] {
        let e = trust.open(env.as_bytes()).unwrap_err();
        let s = e.to_string();
        assert!(s.len() <= driftless_format::MAX_DETAIL + 200, "{what}: {} bytes of error", s.len());
        assert!(!s.contains('\n'), "{what}: more than one line");
        assert!(s.contains("bytes in all"), "{what}: the cut is not said: {s}");
    }
}

/// `one_line` escapes control characters and cuts on a character boundary.
#[test]
fn one_line_escapes_and_cuts_on_a_character() {
    assert_eq!(driftless_format::one_line("a\nb\u{1b}[31m"), "a\\nb\\u{1b}[31m");
    let s = "é".repeat(driftless_format::MAX_DETAIL);
    let o = driftless_format::one_line(&s);
    assert!(o.starts_with(&"é".repeat(driftless_format::MAX_DETAIL / 2)), "{o}");
    assert!(o.contains(&format!("({} bytes in all", s.len())), "{o}");
}
