//! Ed25519 signing of manifests.
//!
//! A signed object is an [`Envelope`]: the exact manifest text plus signatures. The signature
//! covers `"driftless.manifest.v1\0" || payload bytes`, so a signature over anything else
//! (another protocol using the same key) can never be replayed as a manifest. Key ids are
//! fingerprints: `ed25519:` + the first 16 bytes of SHA-256 of the raw public key, in hex.
//! Keys are stored as PEM: PKCS#8 for secret keys, SPKI for public keys.

use std::collections::BTreeMap;
use std::path::Path;

use base64::Engine as _;
use ed25519_dalek::pkcs8::{DecodePrivateKey, DecodePublicKey, EncodePrivateKey, EncodePublicKey};
use ed25519_dalek::{Signer, SigningKey, Verifier, VerifyingKey};
use serde::{Deserialize, Serialize};

use crate::{Digest, Error, Result};

const DOMAIN: &[u8] = b"driftless.manifest.v1\0";

/// Fingerprint of a public key.
pub fn key_id(key: &VerifyingKey) -> String {
    format!("ed25519:{}", hex::encode(&Digest::of(key.as_bytes()).0[..16]))
}

/// A secret signing key with its id.
#[derive(Clone)]
pub struct Keypair {
    key: SigningKey,
    id: String,
}

impl std::fmt::Debug for Keypair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Keypair").field("id", &self.id).finish_non_exhaustive()
    }
}

impl Keypair {
    /// A fresh random key from the OS RNG.
    pub fn generate() -> Self {
        Self::from_signing_key(SigningKey::generate(&mut rand_core::OsRng))
    }
    /// Deterministic key from 32 seed bytes (tests).
    pub fn from_seed(seed: [u8; 32]) -> Self {
        Self::from_signing_key(SigningKey::from_bytes(&seed))
    }
    fn from_signing_key(key: SigningKey) -> Self {
        let id = key_id(&key.verifying_key());
        Keypair { key, id }
    }
    /// Key id.
    pub fn id(&self) -> &str {
        &self.id
    }
    /// Public half.
    pub fn public(&self) -> VerifyingKey {
        self.key.verifying_key()
    }
    /// PKCS#8 PEM of the secret key.
    pub fn to_pem(&self) -> Result<String> {
        Ok(self
            .key
            .to_pkcs8_pem(Default::default())
            .map_err(|e| Error::invalid(format!("encode key: {e}")))?
            .to_string())
    }
    /// SPKI PEM of the public key.
    pub fn public_pem(&self) -> Result<String> {
        public_to_pem(&self.public())
    }
    /// Parses a PKCS#8 PEM secret key.
    pub fn from_pem(pem: &str) -> Result<Self> {
        let key = SigningKey::from_pkcs8_pem(pem)
            .map_err(|e| Error::invalid(format!("not an Ed25519 PKCS#8 PEM key: {e}")))?;
        Ok(Self::from_signing_key(key))
    }
    /// Reads a PKCS#8 PEM secret key file.
    pub fn read(path: &Path) -> Result<Self> {
        let s = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::from_pem(&s)
    }
    /// Signs `payload` into an envelope.
    pub fn seal(&self, payload: &[u8]) -> Result<Vec<u8>> {
        let payload = std::str::from_utf8(payload).map_err(|_| Error::invalid("payload must be UTF-8 JSON"))?;
        let sig = self.key.sign(&[DOMAIN, payload.as_bytes()].concat());
        let env = Envelope {
            payload: payload.to_string(),
            signatures: vec![SignatureEntry {
                key_id: self.id.clone(),
                sig: base64::engine::general_purpose::STANDARD.encode(sig.to_bytes()),
            }],
        };
        Ok(serde_json::to_vec(&env).expect("envelope serializes"))
    }
}

/// SPKI PEM of a public key.
pub fn public_to_pem(key: &VerifyingKey) -> Result<String> {
    key.to_public_key_pem(Default::default()).map_err(|e| Error::invalid(format!("encode key: {e}")))
}

/// Envelope without signatures, for streams that opted out of signing.
pub fn seal_unsigned(payload: &[u8]) -> Result<Vec<u8>> {
    let payload = std::str::from_utf8(payload).map_err(|_| Error::invalid("payload must be UTF-8 JSON"))?;
    Ok(serde_json::to_vec(&Envelope { payload: payload.to_string(), signatures: vec![] }).expect("serializes"))
}

/// A signed document.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct Envelope {
    /// The exact signed text.
    pub payload: String,
    /// Signatures over it.
    pub signatures: Vec<SignatureEntry>,
}

/// One signature.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq, Eq)]
pub struct SignatureEntry {
    /// Signer's key id.
    pub key_id: String,
    /// Base64 Ed25519 signature.
    pub sig: String,
}

/// The public keys a reader accepts, by id. Several keys make rotation possible: trust the new
/// key, switch the publisher, then drop the old one.
#[derive(Debug, Clone, Default)]
pub struct TrustSet {
    keys: BTreeMap<String, VerifyingKey>,
    allow_unsigned: bool,
}

impl TrustSet {
    /// An empty set (refuses everything).
    pub fn new() -> Self {
        Self::default()
    }
    /// Accepts unsigned envelopes too. Only for private buckets and tests.
    pub fn allow_unsigned(mut self, yes: bool) -> Self {
        self.allow_unsigned = yes;
        self
    }
    /// Whether unsigned envelopes pass.
    pub fn allows_unsigned(&self) -> bool {
        self.allow_unsigned
    }
    /// Adds a key.
    pub fn with_key(mut self, key: VerifyingKey) -> Self {
        self.keys.insert(key_id(&key), key);
        self
    }
    /// Adds a key from SPKI PEM.
    pub fn with_pem(self, pem: &str) -> Result<Self> {
        let k = VerifyingKey::from_public_key_pem(pem)
            .map_err(|e| Error::invalid(format!("not an Ed25519 public key PEM: {e}")))?;
        Ok(self.with_key(k))
    }
    /// Adds a key from an SPKI PEM file.
    pub fn with_file(self, path: &Path) -> Result<Self> {
        let s = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        self.with_pem(&s)
    }
    /// Ids of the trusted keys.
    pub fn key_ids(&self) -> Vec<String> {
        self.keys.keys().cloned().collect()
    }
    /// Number of keys.
    pub fn len(&self) -> usize {
        self.keys.len()
    }
    /// True without keys.
    pub fn is_empty(&self) -> bool {
        self.keys.is_empty()
    }

    /// Opens an envelope: returns the payload bytes and the id of the key that signed it
    /// (`None` for an accepted unsigned envelope). At least one signature by a trusted key must
    /// verify; signatures by unknown keys are ignored, a bad signature by a trusted key fails.
    pub fn open(&self, bytes: &[u8]) -> Result<(Vec<u8>, Option<String>)> {
        if bytes.len() > crate::manifest::MAX_MANIFEST_BYTES {
            return Err(Error::corrupt("envelope", "too large"));
        }
        let env: Envelope = serde_json::from_slice(bytes).map_err(|e| Error::corrupt("envelope", e.to_string()))?;
        if env.signatures.is_empty() {
            // Unsigned passes only when no key is trusted at all: with a key configured, a
            // manifest whose signatures were stripped is exactly what signing must catch.
            if self.allow_unsigned && self.keys.is_empty() {
                return Ok((env.payload.into_bytes(), None));
            }
            // The advice depends on why: with keys trusted, allowing unsigned data changes
            // nothing (and `--allow-unsigned` is refused next to `--trust`).
            let detail = if self.keys.is_empty() {
                "unsigned (an unsigned stream is accepted only when allowed explicitly: \
                 --allow-unsigned, or allow_unsigned=True in Python, and no trusted key)"
            } else {
                "unsigned, and a trusted key is configured: unsigned manifests are refused \
                 (the publisher signs nothing, or the signature was stripped)"
            };
            return Err(Error::untrusted("manifest", detail));
        }
        let msg = [DOMAIN, env.payload.as_bytes()].concat();
        let mut seen = vec![];
        for s in &env.signatures {
            seen.push(s.key_id.clone());
            let Some(k) = self.keys.get(&s.key_id) else { continue };
            let raw = base64::engine::general_purpose::STANDARD
                .decode(&s.sig)
                .map_err(|_| Error::untrusted("manifest", "signature is not base64"))?;
            let sig = ed25519_dalek::Signature::from_slice(&raw)
                .map_err(|_| Error::untrusted("manifest", "malformed signature"))?;
            k.verify(&msg, &sig)
                .map_err(|_| Error::untrusted("manifest", format!("signature by {} does not verify", s.key_id)))?;
            return Ok((env.payload.into_bytes(), Some(s.key_id.clone())));
        }
        Err(Error::untrusted("manifest", format!("signed by unknown key(s) {}", seen.join(", "))))
    }
}
