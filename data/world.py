"""A small, deterministic "world" of biomedical text (and of everyday English).

The paper continues pretraining an encoder on biomedical text (PubMed
abstracts and clinical notes). We cannot ship that data, so this module writes
look-alike text from lexicons and templates. Two genres exist: clinical notes
(five note types, each with its own sections) and PubMed-style abstracts
(background, methods, results, conclusions, for four study designs).

The world has learnable structure beyond the templates, which is what keeps a
small model's loss falling after it has learned the sentence shapes:
  * therapeutic areas tie drugs, diseases, genes, organs and symptoms together,
    and a document stays inside one area;
  * every drug has a fixed route, frequency and dose unit (its "label");
  * a document is about one patient or one study, so its drug, disease, gene,
    age and cohort size repeat across sentences (copying from context pays).
Numbers, p-values and the random choice of entities keep it from being
memorized.

A second register, general (corpus(..., register="general")), is everyday English
made the same way: stories, local news and letters about cooking, gardening, football and
other topics, for a general corpus that is not biomedical.

Everything is a pure function of a random.Random, so a seed gives the same text
on every machine and Python 3.8+. Pretraining uses corpus(seed=1234); the
fine-tuning tasks (NER from render()'s BIO tags, note-type classification from
note()) are built from the same lexicons and templates with other seeds: the
model has seen the vocabulary, never the exact sentences.
"""

from __future__ import annotations

import random
import re

# ---------------------------------------------------------------------------
# Lexicons. Each therapeutic area lists what belongs together; the flat
# DRUGS / DISEASES / GENES lists below are their union.

_AREAS = {
    "cardiology": dict(
        drugs=["atorvastatin", "rosuvastatin", "simvastatin", "pravastatin", "ezetimibe",
               "evolocumab", "lisinopril", "enalapril", "ramipril", "losartan", "valsartan",
               "candesartan", "sacubitril-valsartan", "amlodipine", "nifedipine", "diltiazem",
               "verapamil", "metoprolol", "carvedilol", "bisoprolol", "atenolol",
               "hydrochlorothiazide", "chlorthalidone", "furosemide", "torsemide",
               "spironolactone", "eplerenone", "digoxin", "amiodarone", "ivabradine"],
        diseases=["essential hypertension", "heart failure with reduced ejection fraction",
                  "heart failure with preserved ejection fraction", "atrial fibrillation",
                  "coronary artery disease", "acute myocardial infarction", "stable angina",
                  "hypercholesterolemia", "familial hypercholesterolemia",
                  "hypertrophic cardiomyopathy", "dilated cardiomyopathy", "aortic stenosis"],
        genes=["LDLR", "PCSK9", "APOB", "LPA", "MYH7", "MYBPC3", "TTN", "KCNQ1", "SCN5A",
               "NPPB", "ACE", "AGT"],
        organs=["heart", "left ventricle", "aorta", "coronary arteries"],
        symptoms=["chest pain", "exertional dyspnea", "palpitations", "lower extremity edema",
                  "orthopnea", "syncope", "fatigue"],
        processes=["cardiac remodeling", "lipid metabolism", "vascular inflammation",
                   "myocardial fibrosis"],
        specialty="cardiology"),
    "thrombosis": dict(
        drugs=["warfarin", "apixaban", "rivaroxaban", "dabigatran", "edoxaban", "heparin",
               "enoxaparin", "fondaparinux", "clopidogrel", "ticagrelor", "prasugrel",
               "aspirin", "alteplase", "tranexamic acid"],
        diseases=["deep vein thrombosis", "pulmonary embolism", "ischemic stroke",
                  "transient ischemic attack", "peripheral artery disease",
                  "antiphospholipid syndrome", "heparin-induced thrombocytopenia",
                  "venous thromboembolism"],
        genes=["F5", "F2", "VKORC1", "CYP2C9", "CYP2C19", "PROC", "PROS1", "SERPINC1",
               "ITGB3", "P2RY12"],
        organs=["lung", "brain", "lower extremity veins", "carotid arteries"],
        symptoms=["unilateral leg swelling", "pleuritic chest pain", "hemoptysis",
                  "sudden weakness", "slurred speech", "claudication", "easy bruising"],
        processes=["platelet aggregation", "coagulation", "fibrinolysis",
                   "endothelial dysfunction"],
        specialty="vascular medicine"),
    "endocrinology": dict(
        drugs=["metformin", "glipizide", "glimepiride", "pioglitazone", "sitagliptin",
               "linagliptin", "empagliflozin", "dapagliflozin", "canagliflozin", "liraglutide",
               "semaglutide", "dulaglutide", "tirzepatide", "insulin glargine",
               "insulin lispro", "insulin aspart", "levothyroxine", "methimazole",
               "propylthiouracil", "alendronate", "zoledronic acid", "denosumab",
               "teriparatide", "cinacalcet", "hydrocortisone"],
        diseases=["type 2 diabetes mellitus", "type 1 diabetes mellitus",
                  "diabetic ketoacidosis", "gestational diabetes mellitus", "obesity",
                  "metabolic syndrome", "hypothyroidism", "Graves disease",
                  "Hashimoto thyroiditis", "osteoporosis", "primary hyperparathyroidism",
                  "adrenal insufficiency", "diabetic nephropathy",
                  "nonalcoholic fatty liver disease"],
        genes=["TCF7L2", "PPARG", "KCNJ11", "HNF1A", "HNF4A", "GCK", "INS", "FTO", "MC4R",
               "LEP", "TSHR", "TPO", "PNPLA3", "CASR"],
        organs=["pancreas", "thyroid", "liver", "adrenal gland", "bone"],
        symptoms=["polyuria", "polydipsia", "weight gain", "unintentional weight loss",
                  "heat intolerance", "cold intolerance", "fatigue", "blurred vision"],
        processes=["insulin secretion", "glucose uptake", "thyroid hormone synthesis",
                   "bone resorption", "adipogenesis"],
        specialty="endocrinology"),
    "oncology": dict(
        drugs=["tamoxifen", "letrozole", "anastrozole", "trastuzumab", "pertuzumab",
               "cisplatin", "carboplatin", "oxaliplatin", "paclitaxel", "docetaxel",
               "doxorubicin", "cyclophosphamide", "gemcitabine", "5-fluorouracil",
               "capecitabine", "irinotecan", "pembrolizumab", "nivolumab", "atezolizumab",
               "ipilimumab", "osimertinib", "erlotinib", "alectinib", "olaparib",
               "bevacizumab", "cetuximab", "enzalutamide", "abiraterone", "sorafenib",
               "temozolomide"],
        diseases=["breast cancer", "triple-negative breast cancer",
                  "non-small cell lung cancer", "small cell lung cancer", "colorectal cancer",
                  "pancreatic ductal adenocarcinoma", "ovarian cancer", "prostate cancer",
                  "hepatocellular carcinoma", "gastric adenocarcinoma", "cutaneous melanoma",
                  "glioblastoma", "renal cell carcinoma",
                  "head and neck squamous cell carcinoma", "urothelial carcinoma"],
        genes=["BRCA1", "BRCA2", "TP53", "EGFR", "KRAS", "ALK", "ROS1", "BRAF", "PIK3CA",
               "ERBB2", "PTEN", "APC", "MLH1", "MSH2", "CDKN2A", "IDH1", "MGMT", "ESR1",
               "AR", "MET", "RET", "NRAS"],
        organs=["breast", "lung", "colon", "pancreas", "liver", "prostate", "ovary", "kidney",
                "stomach"],
        symptoms=["unintentional weight loss", "night sweats", "fatigue", "anorexia",
                  "bone pain", "persistent cough", "a palpable mass"],
        processes=["cell proliferation", "DNA repair", "angiogenesis",
                   "tumor immune evasion", "epithelial-mesenchymal transition"],
        specialty="oncology"),
    "hematology": dict(
        drugs=["imatinib", "dasatinib", "nilotinib", "ibrutinib", "acalabrutinib",
               "venetoclax", "rituximab", "lenalidomide", "bortezomib", "daratumumab",
               "azacitidine", "cytarabine", "hydroxyurea", "ruxolitinib", "emicizumab",
               "eltrombopag", "ferric carboxymaltose", "folic acid"],
        diseases=["chronic myeloid leukemia", "acute myeloid leukemia",
                  "acute lymphoblastic leukemia", "chronic lymphocytic leukemia",
                  "diffuse large B-cell lymphoma", "follicular lymphoma", "Hodgkin lymphoma",
                  "multiple myeloma", "myelodysplastic syndrome", "polycythemia vera",
                  "sickle cell disease", "iron deficiency anemia", "immune thrombocytopenia",
                  "hemophilia A"],
        genes=["BCR", "ABL1", "JAK2", "FLT3", "NPM1", "CALR", "MPL", "TET2", "DNMT3A", "HBB",
               "BCL2", "MYD88", "CD19", "F8", "TMPRSS6"],
        organs=["bone marrow", "spleen", "lymph nodes", "liver"],
        symptoms=["fatigue", "easy bruising", "recurrent infections", "night sweats",
                  "bone pain", "pallor", "early satiety"],
        processes=["hematopoiesis", "B-cell receptor signaling", "apoptosis",
                   "erythropoiesis"],
        specialty="hematology"),
    "infection": dict(
        drugs=["amoxicillin", "amoxicillin-clavulanate", "azithromycin", "doxycycline",
               "ceftriaxone", "cefazolin", "cephalexin", "cefepime", "ciprofloxacin",
               "levofloxacin", "vancomycin", "linezolid", "daptomycin",
               "piperacillin-tazobactam", "meropenem", "gentamicin",
               "trimethoprim-sulfamethoxazole", "nitrofurantoin", "metronidazole",
               "clindamycin", "rifampin", "isoniazid", "fluconazole", "voriconazole",
               "acyclovir", "valacyclovir", "oseltamivir", "remdesivir", "tenofovir",
               "dolutegravir", "sofosbuvir", "nirmatrelvir"],
        diseases=["community-acquired pneumonia", "hospital-acquired pneumonia",
                  "urinary tract infection", "pyelonephritis", "sepsis", "cellulitis",
                  "infective endocarditis", "osteomyelitis", "pulmonary tuberculosis",
                  "Clostridioides difficile infection", "HIV infection",
                  "chronic hepatitis C", "chronic hepatitis B", "influenza", "COVID-19",
                  "bacterial meningitis", "invasive candidiasis"],
        genes=["CCR5", "IFITM3", "TLR4", "IL6", "TNF", "IFNL3", "MBL2", "HLA-B", "IL10",
               "CD4", "OAS1", "IFNAR2"],
        organs=["lung", "kidney", "bladder", "skin", "heart valves", "bone", "meninges"],
        symptoms=["fever", "chills", "productive cough", "dysuria", "rigors", "erythema",
                  "localized swelling", "headache", "neck stiffness"],
        processes=["innate immune signaling", "viral replication", "bacterial clearance",
                   "cytokine release"],
        specialty="infectious diseases"),
    "pulmonology": dict(
        drugs=["albuterol", "salmeterol", "formoterol", "tiotropium", "umeclidinium",
               "fluticasone", "budesonide", "beclomethasone", "ipratropium", "montelukast",
               "prednisone", "roflumilast", "omalizumab", "mepolizumab", "benralizumab",
               "dupilumab", "pirfenidone", "nintedanib", "ivacaftor",
               "elexacaftor-tezacaftor-ivacaftor"],
        diseases=["asthma", "severe eosinophilic asthma", "chronic obstructive pulmonary disease",
                  "idiopathic pulmonary fibrosis", "cystic fibrosis", "bronchiectasis",
                  "obstructive sleep apnea", "pulmonary arterial hypertension", "sarcoidosis",
                  "allergic rhinitis", "alpha-1 antitrypsin deficiency"],
        genes=["CFTR", "SERPINA1", "MUC5B", "TERT", "IL13", "IL4R", "IL5", "ADAM33",
               "ORMDL3", "BMPR2", "SFTPC", "TSLP"],
        organs=["lung", "airways", "pleura", "pulmonary arteries"],
        symptoms=["wheezing", "shortness of breath", "chronic cough", "sputum production",
                  "chest tightness", "exercise intolerance", "daytime somnolence"],
        processes=["airway inflammation", "mucus clearance", "fibroblast activation",
                   "type 2 inflammation"],
        specialty="pulmonology"),
    "neurology": dict(
        drugs=["carbidopa-levodopa", "pramipexole", "ropinirole", "rasagiline", "donepezil",
               "rivastigmine", "memantine", "lecanemab", "levetiracetam", "lamotrigine",
               "valproate", "carbamazepine", "phenytoin", "topiramate", "lacosamide",
               "gabapentin", "pregabalin", "sumatriptan", "erenumab", "ocrelizumab",
               "natalizumab", "fingolimod", "dimethyl fumarate", "riluzole", "pyridostigmine"],
        diseases=["Parkinson disease", "Alzheimer disease", "focal epilepsy",
                  "generalized epilepsy", "relapsing-remitting multiple sclerosis", "migraine",
                  "amyotrophic lateral sclerosis", "Huntington disease", "myasthenia gravis",
                  "diabetic peripheral neuropathy", "essential tremor",
                  "Guillain-Barre syndrome", "frontotemporal dementia"],
        genes=["APOE", "APP", "PSEN1", "MAPT", "SNCA", "LRRK2", "GBA1", "PRKN", "HTT", "SOD1",
               "C9orf72", "SCN1A", "TARDBP", "GRN"],
        organs=["brain", "spinal cord", "peripheral nerves", "basal ganglia", "hippocampus"],
        symptoms=["tremor", "memory loss", "seizures", "headache", "numbness",
                  "muscle weakness", "gait instability", "double vision"],
        processes=["neuroinflammation", "synaptic transmission", "protein aggregation",
                   "neuronal survival", "axonal transport"],
        specialty="neurology"),
    "psychiatry": dict(
        drugs=["sertraline", "fluoxetine", "escitalopram", "citalopram", "paroxetine",
               "venlafaxine", "duloxetine", "bupropion", "mirtazapine", "trazodone", "lithium",
               "quetiapine", "olanzapine", "risperidone", "aripiprazole", "clozapine",
               "haloperidol", "lorazepam", "clonazepam", "methylphenidate", "atomoxetine",
               "buprenorphine", "naltrexone", "methadone"],
        diseases=["major depressive disorder", "generalized anxiety disorder",
                  "bipolar disorder", "schizophrenia", "post-traumatic stress disorder",
                  "attention deficit hyperactivity disorder", "opioid use disorder",
                  "alcohol use disorder", "obsessive-compulsive disorder", "panic disorder",
                  "chronic insomnia"],
        genes=["SLC6A4", "COMT", "BDNF", "DRD2", "HTR2A", "CACNA1C", "DISC1", "OPRM1",
               "CYP2D6", "FKBP5", "NRXN1"],
        organs=["brain", "prefrontal cortex", "hippocampus", "amygdala"],
        symptoms=["low mood", "anxiety", "insomnia", "poor concentration", "irritability",
                  "auditory hallucinations", "cravings", "anhedonia"],
        processes=["serotonin signaling", "dopamine signaling", "stress hormone regulation",
                   "synaptic plasticity"],
        specialty="psychiatry"),
    "rheumatology": dict(
        drugs=["methotrexate", "hydroxychloroquine", "sulfasalazine", "leflunomide",
               "adalimumab", "etanercept", "infliximab", "certolizumab pegol", "tocilizumab",
               "abatacept", "tofacitinib", "baricitinib", "upadacitinib", "secukinumab",
               "ustekinumab", "allopurinol", "febuxostat", "colchicine", "prednisolone",
               "mycophenolate mofetil", "azathioprine", "belimumab", "vedolizumab",
               "mesalamine"],
        diseases=["rheumatoid arthritis", "systemic lupus erythematosus", "lupus nephritis",
                  "psoriatic arthritis", "ankylosing spondylitis", "gout", "plaque psoriasis",
                  "Crohn disease", "ulcerative colitis", "Sjogren syndrome",
                  "systemic sclerosis", "giant cell arteritis", "atopic dermatitis"],
        genes=["HLA-DRB1", "HLA-B27", "PTPN22", "STAT4", "IRF5", "IL23R", "NOD2", "TNFAIP3",
               "IL17A", "JAK1", "TYK2", "ABCG2", "SLC2A9"],
        organs=["joints", "skin", "colon", "kidney", "synovium", "small intestine"],
        symptoms=["joint pain", "morning stiffness", "joint swelling", "rash", "dry eyes",
                  "bloody diarrhea", "abdominal pain", "low back pain"],
        processes=["T-cell activation", "autoantibody production", "synovial inflammation",
                   "interleukin-17 signaling"],
        specialty="rheumatology"),
    "gastroenterology": dict(
        drugs=["omeprazole", "pantoprazole", "esomeprazole", "famotidine", "ondansetron",
               "metoclopramide", "lactulose", "rifaximin", "ursodiol", "loperamide",
               "linaclotide", "polyethylene glycol", "obeticholic acid", "budesonide"],
        diseases=["gastroesophageal reflux disease", "peptic ulcer disease",
                  "Helicobacter pylori infection", "alcohol-associated cirrhosis",
                  "hepatic encephalopathy", "acute pancreatitis", "irritable bowel syndrome",
                  "primary biliary cholangitis", "celiac disease", "eosinophilic esophagitis"],
        genes=["ATP7B", "HFE", "PNPLA3", "HLA-DQA1", "SPINK1", "PRSS1", "ABCB4", "TM6SF2",
               "CFTR"],
        organs=["esophagus", "stomach", "liver", "pancreas", "colon", "small intestine"],
        symptoms=["heartburn", "nausea", "vomiting", "abdominal pain", "diarrhea",
                  "constipation", "melena", "jaundice", "bloating"],
        processes=["gastric acid secretion", "bile acid metabolism",
                   "intestinal barrier function", "hepatic fibrosis"],
        specialty="gastroenterology"),
    "nephrology": dict(
        drugs=["sevelamer", "calcitriol", "epoetin alfa", "darbepoetin alfa", "tacrolimus",
               "cyclosporine", "sodium bicarbonate", "patiromer", "tolvaptan", "finerenone"],
        diseases=["chronic kidney disease", "acute kidney injury", "end-stage renal disease",
                  "nephrotic syndrome", "autosomal dominant polycystic kidney disease",
                  "IgA nephropathy", "focal segmental glomerulosclerosis",
                  "kidney transplant rejection", "hyperkalemia"],
        genes=["PKD1", "PKD2", "APOL1", "NPHS1", "NPHS2", "UMOD", "COL4A5", "CYP3A5"],
        organs=["kidney", "glomeruli", "renal tubules", "bladder"],
        symptoms=["edema", "foamy urine", "decreased urine output", "fatigue", "pruritus",
                  "hematuria", "flank pain"],
        processes=["glomerular filtration", "tubular injury", "podocyte function",
                   "renal fibrosis"],
        specialty="nephrology"),
    "pain": dict(
        drugs=["acetaminophen", "ibuprofen", "naproxen", "celecoxib", "diclofenac",
               "ketorolac", "tramadol", "oxycodone", "morphine", "hydromorphone", "fentanyl",
               "ketamine", "lidocaine", "dexamethasone", "duloxetine"],
        diseases=["knee osteoarthritis", "hip osteoarthritis", "chronic low back pain",
                  "postoperative pain", "fibromyalgia", "complex regional pain syndrome",
                  "lumbar radiculopathy", "cancer-related pain"],
        genes=["OPRM1", "COMT", "SCN9A", "CYP2D6", "TRPV1", "NGF", "ABCB1"],
        organs=["knee", "hip", "lumbar spine", "joints"],
        symptoms=["joint pain", "low back pain", "radiating leg pain", "stiffness",
                  "sleep disturbance", "constipation"],
        processes=["nociceptive signaling", "central sensitization", "cartilage degradation",
                   "prostaglandin synthesis"],
        specialty="pain medicine"),
}
_AREA_NAMES = list(_AREAS)


def _union(key):
    # Keep first-seen order (never a set) so the lists, and every seed, are stable.
    out = []
    for area in _AREAS.values():
        for item in area[key]:
            if item not in out:
                out.append(item)
    return out


DRUGS = _union("drugs")
DISEASES = _union("diseases")
GENES = _union("genes")
ORGANS = _union("organs")
SYMPTOMS = _union("symptoms")
PROCESSES = _union("processes")

# Doses are a number times a unit; each unit has numbers that make sense for it.
_DOSE_NUMBERS = {
    "mg": ["1", "2.5", "5", "10", "20", "25", "40", "50", "75", "100", "150", "200", "250",
           "300", "400", "500", "600", "750", "1000"],
    "mcg": ["25", "50", "88", "100", "125", "180", "250", "500"],
    "g": ["0.5", "1", "2", "3", "4"],
    "mg/kg": ["0.5", "1", "2", "3", "5", "8", "10", "15"],
    "IU": ["4", "6", "8", "10", "12", "16", "20", "24", "30", "40"],
    "mL": ["5", "10", "15", "20", "30"],
}
DOSES = [f"{n} {unit}" for unit, numbers in _DOSE_NUMBERS.items() for n in numbers]
ROUTES = ["orally", "intravenously", "subcutaneously", "intramuscularly", "by inhalation",
          "topically", "sublingually", "transdermally"]
FREQUENCIES = ["once daily", "twice daily", "three times daily", "every 6 hours",
               "every 8 hours", "every 12 hours", "at bedtime", "once weekly",
               "every 2 weeks", "every 3 weeks", "every 4 weeks", "once monthly",
               "as needed", "every other day", "before meals"]
_INHALED = ["albuterol", "salmeterol", "formoterol", "tiotropium", "umeclidinium",
            "fluticasone", "budesonide", "beclomethasone", "ipratropium"]


def _drug_labels():
    """Give every drug a fixed (doses, route, frequency): facts a model can learn.

    Name patterns make the labels plausible: antibodies ("-mab", "-cept") are
    infused or injected every few weeks, insulins are dosed in IU, inhalers in
    mcg. The rest is drawn from a private, fixed-seed generator.
    """
    rng = random.Random(20240615)
    labels = {}
    for drug in DRUGS:
        if drug.endswith(("mab", "cept")):
            unit = rng.choice(["mg", "mg/kg"])
            route = rng.choice(["intravenously", "subcutaneously"])
            freq = rng.choice(["every 2 weeks", "every 3 weeks", "every 4 weeks", "once monthly"])
        elif drug.startswith("insulin"):
            unit = "IU"
            route = "subcutaneously"
            freq = rng.choice(["once daily", "at bedtime", "before meals"])
        elif drug in _INHALED:
            unit = "mcg"
            route = "by inhalation"
            freq = rng.choice(["once daily", "twice daily", "every 6 hours", "as needed"])
        else:
            unit = rng.choice(["mg"] * 6 + ["mcg", "g", "mL"])
            route = rng.choice(["orally"] * 5 + ["intravenously", "intramuscularly",
                                                 "sublingually", "transdermally", "topically"])
            freq = rng.choice(FREQUENCIES[:8] + ["as needed"])
        doses = [f"{n} {unit}" for n in rng.sample(_DOSE_NUMBERS[unit], 3)]
        labels[drug] = (doses, route, freq)
    return labels


_DRUG_LABELS = _drug_labels()

SPECIES = ["C57BL/6 mice", "BALB/c mice", "nude mice", "Sprague-Dawley rats", "Wistar rats",
           "zebrafish larvae", "New Zealand white rabbits", "rhesus macaques"]
CELL_LINES = ["HeLa", "HEK293", "MCF-7", "A549", "HepG2", "Jurkat", "THP-1", "U87", "Caco-2",
              "SH-SY5Y", "K562", "HCT116"]
# (name, low, high, decimals, unit): values are drawn uniformly in [low, high].
LABS = [("hemoglobin", 6.5, 17.5, 1, "g/dL"), ("white blood cell count", 1.5, 24.0, 1, "K/uL"),
        ("platelet count", 25, 550, 0, "K/uL"), ("sodium", 122, 148, 0, "mmol/L"),
        ("potassium", 2.9, 6.4, 1, "mmol/L"), ("creatinine", 0.5, 5.8, 2, "mg/dL"),
        ("blood urea nitrogen", 6, 88, 0, "mg/dL"), ("glucose", 55, 420, 0, "mg/dL"),
        ("HbA1c", 5.0, 13.2, 1, "%"), ("ALT", 9, 540, 0, "U/L"), ("AST", 11, 610, 0, "U/L"),
        ("total bilirubin", 0.2, 11.5, 1, "mg/dL"), ("albumin", 1.9, 4.9, 1, "g/dL"),
        ("INR", 0.9, 4.6, 1, ""), ("troponin I", 0.01, 9.5, 2, "ng/mL"),
        ("BNP", 25, 3400, 0, "pg/mL"), ("C-reactive protein", 0.4, 240, 1, "mg/L"),
        ("TSH", 0.02, 38, 2, "mIU/L"), ("LDL cholesterol", 42, 255, 0, "mg/dL"),
        ("lactate", 0.6, 8.8, 1, "mmol/L"), ("ferritin", 6, 1800, 0, "ng/mL"),
        ("magnesium", 1.1, 2.9, 1, "mg/dL")]
SEXES = ["man", "woman"]
OUTCOMES = ["all-cause mortality", "hospital readmission", "disease progression",
            "symptom burden", "relapse", "quality of life scores", "major adverse events",
            "emergency department visits", "treatment failure", "functional decline"]
EXAM_FINDINGS = ["bibasilar crackles", "lower extremity edema", "abdominal tenderness",
                 "jugular venous distension", "expiratory wheezes", "joint swelling",
                 "a systolic murmur", "dry mucous membranes", "pallor", "resting tremor"]
IMAGING_FINDINGS = ["atelectasis", "ground-glass opacity", "consolidation",
                    "hepatic steatosis", "cardiomegaly", "degenerative change",
                    "wall thickening", "fat stranding", "small vessel ischemic change"]
IMAGING_SITES = ["liver", "lung", "kidney", "adrenal gland", "pancreas", "spleen", "thyroid",
                 "breast", "brain", "ovary"]
MODALITIES = ["CT", "MRI", "ultrasound", "PET-CT", "contrast-enhanced CT"]
REGIONS = ["chest", "abdomen and pelvis", "head", "neck", "lumbar spine", "pelvis"]
MARKERS = ["CK7", "CK20", "TTF-1", "p40", "GATA3", "CDX2", "PAX8", "CD20", "CD3", "S100",
           "SOX10", "ER", "PR", "synaptophysin"]
_AMINO = "ACDEFGHIKLMNPQRSTVWY"

# ---------------------------------------------------------------------------
# Slot generators: base slot name -> fn(rng) -> text. "DRUG2" uses the DRUG
# generator (trailing digits only make a second, independent value).


def _num(rng, low, high, decimals):
    return f"{rng.uniform(low, high):.{decimals}f}"


def _lab(rng):
    name, low, high, decimals, unit = rng.choice(LABS)
    return f"{name} {_num(rng, low, high, decimals)} {unit}".strip()


def _cohort(rng):
    # Integer draws only (no math.log/exp) so every platform gives the same numbers.
    r = rng.random()
    if r < 0.3:
        return rng.randint(20, 99)
    if r < 0.8:
        return rng.randint(100, 999)
    return rng.randint(1000, 9999)


def _pval(rng):
    if rng.random() < 0.35:
        return "p < 0.001"
    return f"p = {rng.randint(1, 49) / 1000:.3f}"


def _ratio(rng, below_one):
    # An effect estimate with a 95 % CI that excludes 1, on the stated side.
    if below_one:
        v = rng.uniform(0.35, 0.92)
        low = v * rng.uniform(0.6, 0.9)
        high = v + (0.99 - v) * rng.uniform(0.2, 0.9)
    else:
        v = rng.uniform(1.15, 3.2)
        low = 1.01 + (v - 1.01) * rng.uniform(0.1, 0.8)
        high = v * rng.uniform(1.1, 1.6)
    return f"{v:.2f} ( 95 % CI {low:.2f} - {high:.2f} )"


_GENERATORS = {
    "DRUG": lambda r: r.choice(DRUGS),
    "DISEASE": lambda r: r.choice(DISEASES),
    "GENE": lambda r: r.choice(GENES),
    "DOSE": lambda r: r.choice(DOSES),
    "ROUTE": lambda r: r.choice(ROUTES),
    "FREQ": lambda r: r.choice(FREQUENCIES),
    "SYMPTOM": lambda r: r.choice(SYMPTOMS),
    "ORGAN": lambda r: r.choice(ORGANS),
    "PROCESS": lambda r: r.choice(PROCESSES),
    "SPECIALTY": lambda r: _AREAS[r.choice(_AREA_NAMES)]["specialty"],
    "SITE": lambda r: r.choice(IMAGING_SITES),
    "SIDE": lambda r: r.choice(["left", "right"]),
    "SPECIES": lambda r: r.choice(SPECIES),
    "CELL": lambda r: r.choice(CELL_LINES),
    "LAB": _lab,
    "LABNAME": lambda r: r.choice(LABS)[0],
    "OUTCOME": lambda r: r.choice(OUTCOMES),
    "EXAM": lambda r: r.choice(EXAM_FINDINGS),
    "FINDING": lambda r: r.choice(IMAGING_FINDINGS),
    "MODALITY": lambda r: r.choice(MODALITIES),
    "REGION": lambda r: r.choice(REGIONS),
    "MARKER": lambda r: r.choice(MARKERS),
    "AGE": lambda r: str(r.randint(18, 94)),
    "AGEMIN": lambda r: str(r.randint(18, 50)),
    "AGEMAX": lambda r: str(r.randint(60, 90)),
    "MEANAGE": lambda r: _num(r, 38, 76, 1),
    "SEX": lambda r: r.choice(SEXES),
    "PRON": lambda r: r.choice(["he", "she"]),
    "N": lambda r: str(_cohort(r)),
    "EVENTS": lambda r: str(r.randint(5, 900)),
    "K": lambda r: str(r.randint(2, 12)),
    "PCT": lambda r: f"{_num(r, 1, 95, 1)} %",
    "PVAL": _pval,
    "PVAL_NS": lambda r: f"p = {r.randint(6, 95) / 100:.2f}",
    "RATIO_DOWN": lambda r: _ratio(r, True),
    "RATIO_UP": lambda r: _ratio(r, False),
    "DIFF": lambda r: _num(r, -12, 6, 1),
    "HOURS": lambda r: f"{r.choice([6, 12, 24, 48, 72])} hours",
    "DAYS": lambda r: f"{r.randint(2, 14)} days",
    "WEEKS": lambda r: f"{r.choice([2, 4, 6, 8, 12, 16, 24, 26, 48, 52])} weeks",
    "MONTHS": lambda r: f"{r.randint(3, 60)} months",
    "YEARS": lambda r: f"{r.randint(2, 30)} years",
    "YEAR": lambda r: str(r.randint(1995, 2022)),
    "SIZE": lambda r: f"{_num(r, 0.3, 9.5, 1)} cm",
    "VARIANT": lambda r: f"p.{r.choice(_AMINO)}{r.randint(12, 1400)}{r.choice(_AMINO)}",
    "RSID": lambda r: f"rs{r.randint(1000, 99999999)}",
    "STAGE": lambda r: f"pT{r.randint(1, 4)}{r.choice(['', 'a', 'b'])}N{r.randint(0, 2)}",
    "BP": lambda r: f"{r.randint(92, 188)}/{r.randint(52, 108)} mmHg",
    "PULSE": lambda r: f"{r.randint(48, 132)} beats per minute",
    "TEMP": lambda r: f"{_num(r, 36.1, 39.6, 1)} C",
    "SAT": lambda r: f"{r.randint(86, 100)} %",
    "GFR": lambda r: str(r.randint(8, 118)),
    "CONC": lambda r: f"{_num(r, 0.05, 40, 2)} uM",
}

# Slots whose values are named entities, and the BIO label their words get.
ENTITY_SLOTS = {"DRUG": "DRUG", "DISEASE": "DISEASE", "DOSE": "DOSE", "GENE": "GENE"}

# ---------------------------------------------------------------------------
# Templates. Syntax: {SLOT} is filled, [text] is kept with probability 1/2,
# <a|b|c> picks one alternative. Never write an entity (a drug name, a dose...)
# as literal text: only slot values get entity tags.
#
# Each note section is (header choices, templates). The note type itself is
# never written: a classifier must infer it from the content.

_NOTES = {
    "discharge summary": [
        (["HISTORY OF PRESENT ILLNESS :", "REASON FOR ADMISSION :"], [
            "A {AGE}-year-old {SEX} with a history of {DISEASE2} "
                "presented with {SYMPTOM} [and {SYMPTOM2}] of {DAYS} duration .",
            "The patient was admitted for <management|evaluation and treatment|further workup> "
                "of {DISEASE} [after presenting to the emergency department with {SYMPTOM}] .",
            "{PRON} reported {SYMPTOM} for the past {DAYS} [despite taking {DRUG2} at home] .",
            "On arrival , blood pressure was {BP} , heart rate {PULSE} , and temperature {TEMP} .",
        ]),
        (["HOSPITAL COURSE :"], [
            "{PRON} was started on {DRUG} {DOSE} {ROUTE} {FREQ} "
                "with <gradual|prompt|partial> improvement in {SYMPTOM} .",
            "Laboratory studies on admission showed {LAB} and {LAB2} .",
            "{DRUG2} was <held|discontinued|reduced> because of "
                "<worsening renal function|hypotension|{SYMPTOM2}> .",
            "The course was complicated by {DISEASE2} , which "
                "was treated with {DRUG3} [{DOSE3} {FREQ3}] .",
            "{SPECIALTY} was consulted [on hospital day {K}] and "
                "agreed with <the current plan|continuing {DRUG}> .",
        ]),
        (["DISCHARGE MEDICATIONS :", "MEDICATIONS ON DISCHARGE :"], [
            "{DRUG} {DOSE} {ROUTE} {FREQ} .",
            "Continue {DRUG2} {DOSE2} {FREQ2} [for {DAYS}] .",
            "{PRON} was discharged on {DRUG} {DOSE} {FREQ} [and instructed to avoid {DRUG3}] .",
            "<Stop|Hold> {DRUG3} until follow-up .",
        ]),
        (["FOLLOW-UP :", "DISPOSITION :"], [
            "Follow up with <primary care|{SPECIALTY}> in {WEEKS} [to reassess {DISEASE}] .",
            "Repeat {LABNAME} should be checked in {DAYS} .",
            "{PRON} was discharged home in <stable|good|fair> condition .",
            "Return precautions for {SYMPTOM} [or {SYMPTOM2}] "
                "were reviewed with the patient [and family] .",
        ]),
    ],
    "progress note": [
        (["SUBJECTIVE :", "INTERVAL HISTORY :"], [
            "{PRON} reports <improved|persistent|worsening> {SYMPTOM} since yesterday .",
            "No {SYMPTOM2} [or {SYMPTOM3}] overnight .",
            "Tolerating {DRUG} without <side effects|nausea|dizziness> .",
            "{PRON} slept <poorly|well> and is <eating well|"
                "tolerating a regular diet|ambulating with assistance> .",
        ]),
        (["OBJECTIVE :", "EXAM :"], [
            "Vitals : BP {BP} , HR {PULSE} , T {TEMP} , "
                "SpO2 {SAT} on <room air|2 L nasal cannula> .",
            "Labs this morning : {LAB} , {LAB2} [, {LAB3}] .",
            "Exam notable for <mild|moderate|trace> {EXAM} .",
            "Daily weight is <unchanged|down 1 kg|up 2 kg> [from yesterday] .",
        ]),
        (["ASSESSMENT :", "IMPRESSION AND ASSESSMENT :"], [
            "{AGE}-year-old {SEX} with {DISEASE} [and {DISEASE2}] , "
                "<improving|stable|slowly improving|not yet at baseline> .",
            "{DISEASE} , <well controlled|partially controlled|poorly controlled> on {DRUG} .",
            "{SYMPTOM} is <most likely|possibly> related to "
                "{DISEASE2} [versus an adverse effect of {DRUG2}] .",
        ]),
        (["PLAN :"], [
            "Continue {DRUG} {DOSE} {FREQ} .",
            "<Increase|Decrease> {DRUG2} to {DOSE2} {FREQ2} [given {LAB}] .",
            "Recheck {LABNAME} <tomorrow|in the morning|in {DAYS}> .",
            "[Will] consult {SPECIALTY} regarding {DISEASE} [if no improvement] .",
            "Anticipate discharge in {DAYS} [if {SYMPTOM} continues to improve] .",
        ]),
    ],
    "radiology report": [
        (["INDICATION :", "CLINICAL HISTORY :"], [
            "{SYMPTOM} in a patient with {DISEASE} .",
            "Evaluate for <progression of|complications of|response to therapy for> {DISEASE} .",
            "{AGE}-year-old {SEX} on {DRUG} with new {SYMPTOM} .",
        ]),
        (["TECHNIQUE :", "COMPARISON :"], [
            "{MODALITY} of the {REGION} was performed <with|without> intravenous contrast .",
            "Comparison is made to a prior {MODALITY2} from {MONTHS} ago .",
            "Images were obtained in <axial|axial and coronal|"
                "multiple> planes [using a standard protocol] .",
            "No prior studies are available for comparison .",
        ]),
        (["FINDINGS :"], [
            "There is a {SIZE} <nodule|mass|lesion|hypodensity> "
                "in the {SIDE} {SITE} [, previously {SIZE2}] .",
            "The {SITE2} <is normal in size|"
                "demonstrates no focal abnormality|is mildly enlarged> .",
            "No <pleural effusion|pneumothorax|free fluid|"
                "acute fracture|lymphadenopathy> is identified .",
            "<Mild|Moderate|Severe> {FINDING} [is noted] [in the {SIDE} {SITE}] .",
            "Multiple <enlarged|subcentimeter> lymph nodes [measuring up to {SIZE3}] are seen .",
        ]),
        (["IMPRESSION :"], [
            "{SIZE} {SIDE} {SITE} <lesion|nodule|mass> , "
                "<suspicious for|compatible with|concerning for> {DISEASE} .",
            "Findings <are consistent with|may represent|suggest> {FINDING} .",
            "No acute abnormality [of the {SITE2}] .",
            "Recommend follow-up {MODALITY} in {MONTHS} .",
            "<Interval|No> change compared with the prior examination .",
        ]),
    ],
    "pathology report": [
        (["SPECIMEN :", "SPECIMEN SUBMITTED :"], [
            "{ORGAN} , <core needle biopsy|excision|resection|fine needle aspiration> [, {SIDE}] .",
            "Received in formalin labeled with the patient name and {ORGAN} [biopsy] .",
            "Specimen obtained from a {AGE}-year-old {SEX} with a history of {DISEASE2} .",
        ]),
        (["GROSS DESCRIPTION :"], [
            "The specimen consists of <a tan-white|a tan-pink|multiple gray> "
                "<fragment|portion of tissue> measuring {SIZE} in greatest dimension .",
            "A {SIZE2} <firm|soft|well-circumscribed|ill-defined> "
                "lesion is identified {SIZE3} from the nearest margin .",
            "Representative sections are submitted in {K} cassettes .",
        ]),
        (["MICROSCOPIC DESCRIPTION :", "ANCILLARY STUDIES :"], [
            "Sections show <infiltrating|sheets of|nests of> atypical cells "
                "with <marked|moderate> nuclear pleomorphism [and frequent mitoses] .",
            "Tumor cells are positive for {MARKER} and negative for {MARKER2} .",
            "Next-generation sequencing identified a pathogenic {GENE} "
                "variant {VARIANT} [with a variant allele frequency of {PCT}] .",
            "The Ki-67 proliferation index is approximately {PCT} .",
            "<No|Extensive|Focal> lymphovascular invasion is identified .",
            "Mismatch repair proteins are <retained|lost> [by immunohistochemistry] .",
        ]),
        (["DIAGNOSIS :", "FINAL DIAGNOSIS :"], [
            "{DISEASE} , <grade 1|grade 2|grade 3|well differentiated|poorly differentiated> .",
            "Margins are <negative|positive|close> [, with the closest margin at {SIZE3}] .",
            "Metastatic disease is present in {K} lymph nodes .",
            "Pathologic stage {STAGE} .",
        ]),
    ],
    "medication review": [
        (["CURRENT MEDICATIONS :", "MEDICATION LIST :"], [
            "{DRUG} {DOSE} {ROUTE} {FREQ} for {DISEASE} .",
            "{DRUG2} {DOSE2} {FREQ2} [as needed] for {DISEASE2} .",
            "Patient takes {K} prescription medications [and {K2} over-the-counter supplements] .",
        ]),
        (["ADHERENCE :"], [
            "Patient reports missing {K} doses of {DRUG} per week [because of {SYMPTOM}] .",
            "Pharmacy refill records show {PCT} adherence [over the past {MONTHS}] .",
            "{PRON} <uses a pill organizer|"
                "relies on a family member for medications|sets phone reminders> .",
            "{PRON} stopped {DRUG2} {WEEKS} ago because of {SYMPTOM} .",
        ]),
        (["INTERACTIONS AND MONITORING :", "SAFETY :"], [
            "Combining {DRUG} and {DRUG2} <may increase the risk of|could worsen> {SYMPTOM} .",
            "Most recent eGFR is {GFR} mL/min/1.73 m2 "
                "[and {LAB}] , so {DRUG} dosing was reviewed .",
            "No clinically significant interactions were identified [with {DRUG2}] .",
            "{DRUG} requires monitoring of {LABNAME} every {MONTHS} .",
        ]),
        (["RECOMMENDATIONS :"], [
            "Recommend <reducing|increasing> {DRUG} to {DOSE4} {FREQ} .",
            "Consider switching {DRUG2} to {DRUG3} [given {SYMPTOM}] .",
            "Discontinue {DRUG2} [and monitor for {SYMPTOM}] .",
            "Discussed <the plan|these changes|the recommendations> "
                "with the <patient|prescriber|care team> .",
        ]),
    ],
}
NOTE_TYPES = list(_NOTES)
# Note types that only make sense for some areas (no biopsy of a depression).
_NOTE_AREAS = {
    "pathology report": ["oncology", "hematology"],
    "radiology report": [a for a in _AREA_NAMES if a != "psychiatry"],
}

_BACKGROUND = [
    "{DISEASE} is a <leading cause of|major contributor to|common cause of> "
        "<morbidity and mortality|disability|hospitalization> "
        "[<worldwide|in older adults|among working-age adults>] .",
    "{DRUG} is widely used for the treatment of {DISEASE} , but "
        "<its long-term effects remain unclear|its optimal dose remains uncertain|"
        "the mechanism of its benefit is poorly understood> .",
    "Variants in {GENE} have been associated with <increased susceptibility to|"
        "earlier onset of|worse outcomes in> {DISEASE} .",
    "Whether {DRUG} <improves outcomes|reduces {SYMPTOM}|"
        "slows disease progression> in patients with {DISEASE} is unknown .",
    "The prevalence of {DISEASE} has increased by {PCT} over the past {YEARS} .",
    "{GENE} regulates {PROCESS} [in the {ORGAN}] , a pathway implicated in {DISEASE} .",
    "Few studies have examined {DRUG} in patients with both {DISEASE} and {DISEASE2} .",
    "We aimed to evaluate the <efficacy and safety|effectiveness|"
        "cost-effectiveness> of {DRUG} in <adults|patients|older adults> with {DISEASE} .",
]
_CONCLUSION = [
    "{DRUG} <significantly|modestly> reduced {OUTCOME} in patients with {DISEASE} .",
    "These findings <support|suggest> a role for {GENE} in "
        "{DISEASE} [and identify a potential therapeutic target] .",
    "Larger <randomized trials|prospective studies> "
        "are needed to confirm these <findings|results> .",
    "{DRUG} <was well tolerated|had an acceptable safety profile> [at {DOSE}] .",
    "<In conclusion|Overall|Taken together> , {DRUG} may be a "
        "<promising|reasonable|cost-effective> option for {DISEASE} .",
    "Clinicians should monitor for {SYMPTOM} when "
        "prescribing {DRUG} [to patients with {DISEASE2}] .",
]
# Study designs: an abstract uses one design for its methods and results.
_DESIGNS = {
    "trial": dict(methods=[
        "In this <randomized|double-blind|multicenter> , <placebo-controlled|open-label|"
            "active-controlled> trial , {N} patients with {DISEASE} "
            "were assigned to {DRUG} or <placebo|{DRUG2}|usual care> .",
        "Patients received {DRUG} {DOSE} {ROUTE} {FREQ} for {WEEKS} .",
        "The primary endpoint was <change in {LABNAME}|time to {OUTCOME}|{OUTCOME}> at {WEEKS} .",
        "Eligible participants were aged {AGEMIN} to {AGEMAX} "
            "years [and had {DISEASE} for at least {YEARS}] .",
        "Randomization was stratified by <site|age and sex|baseline {LABNAME}> .",
    ], results=[
        "A total of {N} participants were randomized ( "
            "{DRUG} , n = {N1} ; <placebo|control> , n = {N2} ) .",
        "{DRUG} reduced {OUTCOME} compared with control ( hazard ratio {RATIO_DOWN} ; {PVAL} ) .",
        "The mean change in {LABNAME} was {DIFF} in the {DRUG} "
            "group versus {DIFF2} in the control group ( {PVAL} ) .",
        "There was no significant difference in {OUTCOME} between groups ( {PVAL_NS} ) .",
        "Adverse events occurred in {PCT} of patients receiving {DRUG} and "
            "{PCT2} of those receiving <placebo|control> , most commonly {SYMPTOM} .",
        "Treatment discontinuation due to {SYMPTOM} was "
            "reported in {K} patients [in the {DRUG} group] .",
        "Response rates were {PCT} and {PCT2} , respectively ( odds ratio {RATIO_UP} ) .",
    ]),
    "cohort": dict(methods=[
        "We conducted a <retrospective|prospective|population-based> cohort study of {N} <adults|"
            "patients|veterans|older adults> with {DISEASE} [treated between {YEAR} and {YEAR2}] .",
        "Exposure to {DRUG} was ascertained from <pharmacy dispensing records|"
            "electronic health records|self-report questionnaires> .",
        "Cox proportional hazards models estimated the association between "
            "{DRUG} use and {OUTCOME} [, adjusting for age , sex , and {DISEASE2}] .",
        "Participants were followed for a median of {MONTHS} .",
    ], results=[
        "During follow-up , {EVENTS} <events|deaths|"
            "hospitalizations> occurred [among {N} participants] .",
        "Use of {DRUG} was associated with a <lower|reduced> risk "
            "of {OUTCOME} ( adjusted hazard ratio {RATIO_DOWN} ) .",
        "{DISEASE2} was associated with a higher risk of "
            "{OUTCOME} ( hazard ratio {RATIO_UP} ; {PVAL} ) .",
        "The mean age was {MEANAGE} years and {PCT} were women .",
        "The association was <consistent|attenuated|stronger> in patients "
            "older than {AGEMAX} years ( {PVAL_NS} for interaction ) .",
        "Results were similar in sensitivity analyses [excluding patients with {DISEASE2}] .",
    ]),
    "lab": dict(methods=[
        "{SPECIES} were treated with {DRUG} ( {DOSE5} ) or vehicle for {WEEKS} .",
        "{CELL} cells were <transfected with siRNA targeting {GENE}|exposed to {DRUG}|"
            "cultured with increasing concentrations of {DRUG}> [for {HOURS}] .",
        "<Western blotting|Quantitative PCR|Immunohistochemistry|RNA sequencing|"
            "Flow cytometry> was used to measure {GENE} expression [in the {ORGAN}] .",
        "{GENE} knockout {SPECIES} were generated using <CRISPR-Cas9|"
            "homologous recombination|Cre-lox recombination> .",
    ], results=[
        "{DRUG} reduced {GENE} expression by {PCT} [compared with vehicle] ( {PVAL} ) .",
        "Loss of {GENE} <increased|decreased> {PROCESS} in the {ORGAN} ( {PVAL} ) .",
        "Treated {SPECIES} showed {PCT} less {PROCESS} than controls .",
        "{GENE} expression did not differ between groups ( {PVAL_NS} ) .",
        "These effects were <reversed|abolished|attenuated> by "
            "<co-treatment with {DRUG2}|{GENE2} overexpression> .",
        "{DRUG} <dose-dependently|significantly> inhibited "
            "{PROCESS} in {CELL} cells [with an IC50 of {CONC}] .",
    ]),
    "genetic": dict(methods=[
        "We performed a <genome-wide association study|case-control study|"
            "whole-exome sequencing study> of {N} <cases|"
            "patients> with {DISEASE} and {N2} controls .",
        "<Participants|Samples> were genotyped for {K} variants in {GENE} [and {GENE2}] .",
        "Logistic regression was used to test associations "
            "[under an additive model] [, adjusting for ancestry] .",
        "Replication was performed in an independent cohort of {N1} individuals .",
    ], results=[
        "The {GENE} variant {RSID} was associated with "
            "{DISEASE} ( odds ratio {RATIO_UP} ; {PVAL} ) .",
        "Carriers of {GENE} {VARIANT} had an earlier age "
            "at onset ( {MEANAGE} versus {MEANAGE2} years ) .",
        "No association was observed for {GENE2} ( {PVAL_NS} ) .",
        "Pathogenic variants in {GENE} were identified in {PCT} of cases and {PCT2} of controls .",
        "The association was <replicated|not replicated> in the independent cohort .",
        "{GENE} risk alleles <modified|did not modify> the response to {DRUG} .",
    ]),
}
_ABSTRACT_HEADERS = [["BACKGROUND :", "OBJECTIVE :", "INTRODUCTION :"], ["METHODS :"],
                     ["RESULTS :"], ["CONCLUSIONS :", "CONCLUSION :"]]

GENRES = ["note", "abstract"]
# Every template, by genre (handy for tests and for building fine-tuning sets).
TEMPLATES = {
    "note": [t for sections in _NOTES.values() for _, pool in sections for t in pool],
    "abstract": _BACKGROUND + _CONCLUSION + [t for d in _DESIGNS.values()
                                             for t in d["methods"] + d["results"]],
}

# ---------------------------------------------------------------------------
# Rendering.

_OPTIONAL = re.compile(r"\[([^\[\]]*)\]")
_CHOICE = re.compile(r"<([^<>]*)>")
_SLOT = re.compile(r"\{([A-Z_]+[0-9]*)\}")
# A word is letters/digits, optionally joined by - / . ' + inside it ("0.5",
# "mg/kg", "HLA-B27", "p.V600E"); any other non-space character stands alone,
# so "mg." becomes "mg" "." like pre-tokenized PubMed NER corpora.
_WORD = re.compile(r"[A-Za-z0-9]+(?:[-/.'+][A-Za-z0-9]+)*|\S")


def _expand(pattern, text, pick):
    # Innermost first, repeated, so "[a <b|c>]" and "[a [b]]" both work.
    while True:
        new = pattern.sub(pick, text)
        if new == text:
            return text
        text = new


def render(template: str, rng: random.Random,
           fill: dict | None = None) -> tuple[list[str], list[str]]:
    """Fill a template; return its words and one BIO tag per word.

    Values in `fill` win over random ones (fill={"DRUG": "metformin"}). A slot
    used twice in one template gets the same value both times.
    """
    text = _expand(_OPTIONAL, template, lambda m: m.group(1) if rng.random() < 0.5 else "")
    text = _expand(_CHOICE, text, lambda m: rng.choice(m.group(1).split("|")))
    # Build the sentence and remember the character span of every entity value;
    # then split into words and tag each word by the span it falls in.
    sentence_text, spans = _fill_slots(text, rng, fill)
    words = []
    tags = []
    for m in _WORD.finditer(sentence_text):
        tag = "O"
        for start, end, label in spans:
            if m.start() < end and m.end() > start:  # overlaps this entity
                if m.start() < start or m.end() > end:
                    raise ValueError(f"template {template!r}: word {m.group()!r} "
                                     "crosses an entity boundary")
                tag = ("B-" if m.start() == start else "I-") + label
        words.append(m.group())
        tags.append(tag)
    if words and words[0][0].islower():
        words[0] = words[0][0].upper() + words[0][1:]  # sentence case
    return words, tags


def _fill_slots(text, rng, fill):
    """The text with every {SLOT} filled -> (sentence, [(start, end, entity label)] of the
    entity values in it)."""
    values = dict(fill or {})
    pieces = []
    spans = []
    length = 0  # of the sentence so far
    last = 0  # where the text after the last slot starts
    for m in _SLOT.finditer(text):
        key = m.group(1)
        base = key.rstrip("0123456789")
        if key not in values:
            values[key] = _GENERATORS[base](rng)
        pieces += [text[last:m.start()], values[key]]
        length += m.start() - last
        if base in ENTITY_SLOTS:
            spans.append((length, length + len(values[key]), ENTITY_SLOTS[base]))
        length += len(values[key])
        last = m.end()
    pieces.append(text[last:])
    return "".join(pieces), spans


def _case(rng, areas=None):
    """The facts one document is about: one patient, or one study, in one area."""
    area = _AREAS[rng.choice(areas or _AREA_NAMES)]
    drug, drug2, drug3 = rng.sample(area["drugs"], 3)
    gene, gene2 = rng.sample(area["genes"], 2)
    sym = rng.sample(area["symptoms"], 3)
    disease = rng.choice(area["diseases"])
    other = rng.choice([d for d in DISEASES if d != disease])  # a comorbidity, any area
    sex = rng.choice(SEXES)
    n = _cohort(rng)
    n1 = n // 2 + rng.randint(-(n // 8), n // 8)
    year = rng.randint(1995, 2015)
    fill = {
        "DRUG": drug, "DRUG2": drug2, "DRUG3": drug3,
        "DISEASE": disease, "DISEASE2": other, "GENE": gene, "GENE2": gene2,
        "SYMPTOM": sym[0], "SYMPTOM2": sym[1], "SYMPTOM3": sym[2],
        "ORGAN": rng.choice(area["organs"]), "PROCESS": rng.choice(area["processes"]),
        "SPECIALTY": area["specialty"],
        "AGE": str(rng.randint(18, 94)), "SEX": sex, "PRON": "he" if sex == "man" else "she",
        "N": str(n), "N1": str(n1), "N2": str(n - n1),
        "YEAR": str(year), "YEAR2": str(year + rng.randint(2, 8)),
        "SPECIES": rng.choice(SPECIES), "CELL": rng.choice(CELL_LINES),
        # One lesion per imaging study, so findings and impression agree.
        "SITE": rng.choice(IMAGING_SITES), "SIDE": rng.choice(["left", "right"]),
        "SIZE": _GENERATORS["SIZE"](rng), "MODALITY": rng.choice(MODALITIES),
    }
    # Each drug follows its label: DOSE/ROUTE/FREQ belong to DRUG, ...2 to DRUG2,
    # ...3 to DRUG3. DOSE4 is another dose of DRUG (a dose change); DOSE5 is a
    # per-kilogram dose for animal studies.
    for suffix, name in (("", drug), ("2", drug2), ("3", drug3)):
        doses, route, freq = _DRUG_LABELS[name]
        fill["DOSE" + suffix] = rng.choice(doses)
        fill["ROUTE" + suffix] = route
        fill["FREQ" + suffix] = freq
    fill["DOSE4"] = rng.choice([d for d in _DRUG_LABELS[drug][0] if d != fill["DOSE"]])
    fill["DOSE5"] = f"{rng.choice(_DOSE_NUMBERS['mg/kg'])} mg/kg"
    return fill


def _pick(rng, pool, k):
    # Distinct templates in their listed order (a note's history comes before
    # its vitals), then repeats with new slot values if the section is long.
    chosen = [pool[i] for i in sorted(rng.sample(range(len(pool)), min(k, len(pool))))]
    return chosen + [rng.choice(pool) for _ in range(k - len(chosen))]


def _compose(rng, sections, fill, weights):
    """Render 4 to 14 sentences spread over the sections, in section order."""
    counts = [1] * len(sections)
    for _ in range(rng.randint(4, 14) - len(sections)):
        counts[rng.choices(range(len(sections)), weights)[0]] += 1
    headers = rng.random() < 0.5  # half the documents carry section headers
    words = []
    for (names, pool), k in zip(sections, counts):
        if headers:
            words += rng.choice(names).split()
        for template in _pick(rng, pool, k):
            words += render(template, rng, fill)[0]
    return " ".join(words)


def note(rng: random.Random, note_type: str | None = None) -> tuple[str, str]:
    """One clinical note: (text, note_type). The type is never in the text."""
    if note_type is None:
        note_type = rng.choice(NOTE_TYPES)
    if note_type not in _NOTES:
        raise ValueError(f"unknown note type {note_type!r}; expected one of {NOTE_TYPES}")
    fill = _case(rng, _NOTE_AREAS.get(note_type))
    sections = _NOTES[note_type]
    return _compose(rng, sections, fill, [1] * len(sections)), note_type


def _abstract(rng):
    fill = _case(rng)
    design = _DESIGNS[rng.choice(list(_DESIGNS))]
    pools = [_BACKGROUND, design["methods"], design["results"], _CONCLUSION]
    # Results get more sentences than the other sections, as in real abstracts.
    return _compose(rng, list(zip(_ABSTRACT_HEADERS, pools)), fill, [1, 1, 2, 1])


def _check_genre(genre):
    if genre not in GENRES:
        raise ValueError(f"unknown genre {genre!r}; expected 'note', 'abstract' or None")
    return genre


def sentence(rng: random.Random, genre: str | None = None) -> tuple[list[str], list[str]]:
    """One random templated sentence as (words, BIO tags)."""
    genre = _check_genre(genre or rng.choice(GENRES))
    if genre == "note":
        note_type = rng.choice(NOTE_TYPES)
        template = rng.choice(rng.choice(_NOTES[note_type])[1])
        fill = _case(rng, _NOTE_AREAS.get(note_type))
    else:
        template = rng.choice(TEMPLATES["abstract"])
        fill = _case(rng)
    return render(template, rng, fill)


def document(rng: random.Random, genre: str | None = None) -> str:
    """One document (a note or an abstract of 4 to 14 sentences) as one string."""
    genre = _check_genre(genre or rng.choice(GENRES))
    return note(rng)[0] if genre == "note" else _abstract(rng)


# ---------------------------------------------------------------------------
# The general register: everyday English, for a corpus that is not biomedical (a general
# pretraining phase before the domain, as the paper's encoder had). Made the way the biomedical
# text is: lexicons, one case a document, templates composed by _compose. Topics play the part of
# the therapeutic areas: a document stays inside one, and its people, town, place and things
# repeat across its sentences. Three genres: a personal story, a local news report, a letter.

_TOPICS = {
    "cooking": dict(
        things=["bread", "soup", "apple pie", "pasta", "vegetable curry", "pancakes", "stew",
                "chocolate cake", "omelette", "lemon tart", "pizza", "rice pudding"],
        places=["kitchen", "market", "bakery", "corner shop", "cafe"],
        activities=["baking bread", "making soup", "cooking for friends", "trying new recipes",
                    "chopping vegetables", "decorating cakes"],
        roles=["the baker", "the woman at the market stall", "our neighbour", "the chef"],
        events=["village bake-off", "food festival", "harvest supper", "charity lunch"],
        adjectives=["warm", "crispy", "sweet", "salty", "homemade", "burnt"]),
    "gardening": dict(
        things=["tomato plants", "rose bush", "watering can", "wheelbarrow", "spade",
                "seed packets", "apple tree", "compost heap", "greenhouse", "lawn mower"],
        places=["allotment", "garden centre", "back garden", "community garden", "park"],
        activities=["planting bulbs", "pulling weeds", "mowing the lawn", "pruning the hedge",
                    "picking beans", "digging a new bed"],
        roles=["the gardener", "the man at the next plot", "the park keeper", "our neighbour"],
        events=["flower show", "plant sale", "open gardens weekend", "spring fair"],
        adjectives=["green", "muddy", "overgrown", "tidy", "blooming", "tall"]),
    "football": dict(
        things=["new boots", "match ball", "team shirt", "season ticket", "goal posts",
                "water bottle", "kit bag", "scarf"],
        places=["stadium", "training ground", "pitch", "sports hall", "pub"],
        activities=["playing five-a-side", "training with the team", "watching the match",
                    "practising penalties", "running laps"],
        roles=["the coach", "the referee", "the captain", "the groundsman"],
        events=["cup final", "derby", "summer tournament", "end of season dinner"],
        adjectives=["muddy", "exciting", "tense", "noisy", "late", "famous"]),
    "music": dict(
        things=["guitar", "piano", "violin", "drum kit", "song book", "new album",
                "concert tickets", "microphone", "record player"],
        places=["music shop", "church hall", "concert hall", "record shop", "village hall"],
        activities=["learning the guitar", "singing in the choir", "practising scales",
                    "writing songs", "playing in a band"],
        roles=["the music teacher", "the conductor", "the drummer", "the man at the shop"],
        events=["spring concert", "open mic night", "brass band contest", "carol service"],
        adjectives=["loud", "quiet", "beautiful", "out of tune", "lively", "old"]),
    "travel": dict(
        things=["train tickets", "suitcase", "map", "rucksack", "camera", "guidebook",
                "umbrella", "sandwiches", "timetable"],
        places=["station", "harbour", "bus stop", "seaside", "youth hostel", "castle"],
        activities=["walking along the coast", "catching the early train", "exploring old towns",
                    "cycling by the river", "visiting museums"],
        roles=["the guard", "the driver", "the woman at the ticket office", "our guide"],
        events=["summer holiday", "day trip", "coach tour", "bank holiday weekend"],
        adjectives=["crowded", "delayed", "peaceful", "windy", "long", "scenic"]),
    "school": dict(
        things=["homework", "reading book", "lunch box", "school bag", "pencil case",
                "science project", "report card", "uniform"],
        places=["school", "library", "classroom", "playground", "school hall"],
        activities=["reading stories", "doing homework", "learning to spell",
                    "painting pictures", "practising times tables"],
        roles=["the teacher", "the head teacher", "the librarian", "the lollipop lady"],
        events=["sports day", "school play", "parents evening", "summer fete"],
        adjectives=["busy", "noisy", "clever", "shy", "cheerful", "new"]),
    "home": dict(
        things=["kitchen table", "paint", "bookshelf", "ladder", "toolbox", "curtains",
                "washing machine", "sofa", "light bulbs"],
        places=["hardware shop", "attic", "living room", "shed", "furniture shop"],
        activities=["painting the hall", "fixing the fence", "clearing out the attic",
                    "putting up shelves", "moving furniture"],
        roles=["the plumber", "the electrician", "the landlord", "the man next door"],
        events=["car boot sale", "street party", "jumble sale", "house warming"],
        adjectives=["old", "broken", "heavy", "bright", "dusty", "second-hand"]),
    "pets": dict(
        things=["dog lead", "cat basket", "bag of food", "tennis ball", "bird cage",
                "fish tank", "new collar", "blanket"],
        places=["park", "vet", "pet shop", "woods", "beach"],
        activities=["walking the dog", "brushing the cat", "training the puppy",
                    "feeding the ducks", "cleaning the hutch"],
        roles=["the vet", "the dog walker", "the woman at the pet shop", "our neighbour"],
        events=["dog show", "pet fair", "charity walk", "open day at the shelter"],
        adjectives=["playful", "sleepy", "fluffy", "hungry", "friendly", "naughty"]),
}
_TOPIC_NAMES = list(_TOPICS)
NAMES = ["Alice", "Ben", "Chloe", "Daniel", "Emma", "Frank", "Grace", "Harry", "Isla", "Jack",
         "Katie", "Liam", "Megan", "Noah", "Olivia", "Peter", "Rosie", "Sam", "Tom", "Lucy",
         "Mary", "George", "Ruth", "Oscar", "Hannah", "Joe", "Ellie", "Martin", "Sophie", "Will"]
SURNAMES = ["Smith", "Jones", "Taylor", "Brown", "Wilson", "Evans", "Walker", "Wright",
            "Hughes", "Green", "Hall", "Wood", "Clarke", "Turner", "Hill", "Baker"]
TOWNS = ["Ashford", "Bramley", "Castleton", "Dunmore", "Eastwick", "Fairholme", "Greenhill",
         "Hartley", "Kingsbridge", "Longford", "Millbrook", "Northam", "Oakridge", "Redcliffe",
         "Stanton", "Westbury"]
KIN = ["friend", "cousin", "neighbour", "flatmate", "colleague", "old school friend"]  # any name
WEEKDAYS = ["Monday", "Tuesday", "Wednesday", "Thursday", "Friday", "Saturday", "Sunday"]
MONTH_NAMES = ["January", "February", "March", "April", "May", "June", "July", "August",
               "September", "October", "November", "December"]
WEATHER = ["sunny", "rainy", "cold", "warm", "foggy", "windy", "grey", "frosty", "stormy"]
_TOPIC_SLOTS = (("THING", "things"), ("PLACE", "places"), ("ACTIVITY", "activities"),
                ("ROLE", "roles"), ("EVENT", "events"), ("ADJ", "adjectives"))


def _topic_pick(key):
    """A slot's generator: a value of `key` from any topic (what a case leaves open)."""
    return lambda r: r.choice(_TOPICS[r.choice(_TOPIC_NAMES)][key])


# The general slots, beside the biomedical ones (a slot name means one thing in both
# registers): a case's values win, these fill what a case leaves open.
_GENERATORS.update({
    "NAME": lambda r: r.choice(NAMES),
    "SURNAME": lambda r: r.choice(SURNAMES),
    "TOWN": lambda r: r.choice(TOWNS),
    "KIN": lambda r: r.choice(KIN),
    "WEEKDAY": lambda r: r.choice(WEEKDAYS),
    "MONTH": lambda r: r.choice(MONTH_NAMES),
    "WEATHER": lambda r: r.choice(WEATHER),
    "DAYNUM": lambda r: str(r.randint(1, 28)),
    "TIME": lambda r: f"{r.randint(1, 12)}.{r.choice(['00', '15', '30', '45'])} "
                      f"{r.choice(['am', 'pm'])}",
    "PRICE": lambda r: f"{r.randint(2, 60)} pounds",
    "DURATION": lambda r: r.choice(["half an hour", "an hour", "an hour and a half", "two hours",
                                    "three hours"]),
    **{slot: _topic_pick(key) for slot, key in _TOPIC_SLOTS},
})

_STORY = [
    ([""], [
        "Last {WEEKDAY} I went to the {PLACE} in {TOWN} with my {KIN} {NAME} .",
        "It was a {WEATHER} {WEEKDAY} in {MONTH} when {NAME} called me about the {EVENT} .",
        "<On|Most> {WEEKDAY}s , {NAME} and I <spend the afternoon|spend an hour> {ACTIVITY} .",
        "I have been {ACTIVITY} for {YEARS} now [, and I still enjoy it] .",
        "The weather in {TOWN} was {WEATHER} , so we <stayed close to home|went out early|"
            "took the bus> .",
    ]),
    ([""], [
        "We <took|fetched|carried> the {THING} <to|from> the {PLACE} [for {NAME2}] .",
        "{NAME} showed me what to do with the {THING2} [without making a mess] .",
        "After lunch we spent {DURATION} {ACTIVITY} [at the {PLACE}] .",
        "<Halfway through|Later that day|By the afternoon> , the {THING} <went missing|"
            "was nowhere to be found|turned out to be the wrong one> .",
        "<Luckily|Fortunately|In the end> , {ROLE} <helped us|lent us another one|"
            "knew exactly what to do> .",
        "We talked about the {EVENT} and whether {NAME2} would <come|be ready|join us> .",
        "The {ADJ} {THING} was <the best part of the day|a real surprise|harder than it looked> .",
        "I <forgot|lost|left> my {THING3} at the {PLACE} [, again] .",
    ]),
    ([""], [
        "We got home <just before dark|late in the evening|around {TIME}> , <tired but happy|"
            "cold and hungry|in a good mood> .",
        "Next {WEEKDAY} we <plan to|want to|might> <go back|try again|do it all again> .",
        "<All in all|In the end|Looking back> , it was a <lovely|long|memorable> day .",
        "{NAME} says we should <start earlier|bring the {THING2}|invite {NAME2}> next time .",
    ]),
]
_NEWS = [
    (["LOCAL NEWS :", "AROUND TOWN :", "COMMUNITY :"], [
        "{TOWN} will hold its {EVENT} on {WEEKDAY} {DAYNUM} {MONTH} .",
        "<More than|Nearly|About> {N} people <came to|took part in> the {EVENT} in {TOWN} "
            "<last weekend|on {WEEKDAY}|this week> .",
        "The {PLACE} in {TOWN} <has reopened|will close for repairs|is looking for volunteers> "
            "[after {MONTHS}] .",
        "People in {TOWN} <are invited to|can sign up for|have asked for more> classes in "
            "{ACTIVITY} at the {PLACE} .",
    ]),
    (["DETAILS :"], [
        "Tickets cost {PRICE} [and can be bought at the {PLACE}] .",
        "The {EVENT} starts at {TIME} and <ends|finishes> {DURATION} later .",
        "Organisers expect {WEATHER} weather [and advise visitors to bring an umbrella] .",
        "<Last year|In {YEAR}> , the <same|first> {EVENT} raised {N} pounds for the {PLACE} .",
        "{ROLE} said the {THING} had been <donated|made|repaired> by <local volunteers|"
            "a family in {TOWN}|pupils from the school> .",
        "Parking near the {PLACE} will be limited [on {WEEKDAY}] .",
    ]),
    (["WHAT THEY SAY :"], [
        "\" We are <delighted|proud|very grateful> to see so many people {ACTIVITY} , \" said "
            "{NAME} {SURNAME} , <one of the organisers|a local resident> .",
        "{NAME} {SURNAME} , who runs the {PLACE} , said the <response|turnout|support> had been "
            "<wonderful|better than expected|encouraging> .",
        "\" It is a <great|simple|cheap> way to <meet people|get outside|learn something new> "
            ", \" {NAME} added .",
    ]),
    (["WHAT NEXT :", "COMING UP :"], [
        "The next {EVENT} is planned for {MONTH} .",
        "More information is available from the {PLACE} [or from {NAME} {SURNAME}] .",
        "Volunteers are <still needed|welcome|asked to sign up by {WEEKDAY}> .",
    ]),
]
_LETTER = [
    ([""], [
        "Dear {NAME2} , thank you for your <letter|message|postcard> [from {TOWN}] .",
        "I hope you and your {KIN} are <well|keeping warm|enjoying the {WEATHER} weather> .",
        "Life here in {TOWN} has been <quiet|busy|much the same> [since {MONTH}] .",
        "I have <started|taken up|gone back to> {ACTIVITY} [at the {PLACE}] .",
        "My {KIN} {NAME} <has|finally has> a new {THING} [and uses it every day] .",
    ]),
    ([""], [
        "We are <thinking of|planning on> visiting you in {MONTH} [, if that suits you] .",
        "Would you like to come to the {EVENT} with us on {WEEKDAY} ?",
        "I will bring the {THING} you asked about [and the {THING2}] .",
        "The train from {TOWN} takes about {DURATION} [, so we could meet for lunch] .",
    ]),
    ([""], [
        "<Write soon|Say hello to everyone|Take care> , and give my love to {NAME} .",
        "With love from {NAME3} .",
        "<See you soon|Until next time|Speak soon> !",
    ]),
]
# Genres of the general register: (sections, each section's weight when sentences are spread).
GENERAL_GENRES = {"story": (_STORY, [1, 3, 1]), "news": (_NEWS, [1, 2, 1, 1]),
                  "letter": (_LETTER, [3, 2, 1])}
GENERAL_TEMPLATES = {genre: [t for _, pool in sections for t in pool]
                     for genre, (sections, _) in GENERAL_GENRES.items()}


def _general_case(rng):
    """The facts one general document is about: its people, town and day, in one topic."""
    topic = _TOPICS[rng.choice(_TOPIC_NAMES)]
    names = rng.sample(NAMES, 3)
    things = rng.sample(topic["things"], 3)
    fill = {"NAME": names[0], "NAME2": names[1], "NAME3": names[2],
            "THING": things[0], "THING2": things[1], "THING3": things[2]}
    for slot, key in _TOPIC_SLOTS[1:]:  # THING's three are drawn above
        fill[slot] = rng.choice(topic[key])
    for slot, pool in (("SURNAME", SURNAMES), ("TOWN", TOWNS), ("KIN", KIN),
                       ("WEEKDAY", WEEKDAYS), ("MONTH", MONTH_NAMES), ("WEATHER", WEATHER)):
        fill[slot] = rng.choice(pool)
    return fill


def general_document(rng: random.Random, genre: str | None = None) -> str:
    """One document of the general register (a story, a news report or a letter of 4 to 14
    sentences) as one string."""
    genre = genre or rng.choice(list(GENERAL_GENRES))
    if genre not in GENERAL_GENRES:
        raise ValueError(f"unknown general genre {genre!r}; expected one of "
                         f"{list(GENERAL_GENRES)} or None")
    sections, weights = GENERAL_GENRES[genre]
    return _compose(rng, sections, _general_case(rng), weights)


REGISTERS = {"bio": document, "general": general_document}  # corpus's registers, by document


def corpus(n_docs: int, seed: int = 1234, register: str = "bio") -> list[str]:
    """n_docs documents of a register: bio (notes and abstracts, the default corpus) or general
    (everyday English); the same list for the same seed on every machine."""
    if register not in REGISTERS:
        raise ValueError(f"unknown register {register!r}; expected one of {list(REGISTERS)}")
    rng = random.Random(seed)
    return [REGISTERS[register](rng) for _ in range(n_docs)]


if __name__ == "__main__":
    # A quick look: python data/world.py
    demo = random.Random(0)
    for _ in range(2):
        print(document(demo), "\n")
    print(list(zip(*sentence(demo))))
